//! Two processes of the node share one physical allocation through the driver's shareable
//! handles (`cuMemExportToShareableHandle` / `cuMemImportFromShareableHandle` with
//! `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, the file descriptor passed over a unix socket, as
//! PyTorch's expandable segments share memory between processes): the importer reads what the
//! exporter wrote and the exporter reads the importer's answer; the allocation counts once on the
//! device, and under libtessera.so the importer is not charged for it.
//!
//! The program is Python's ctypes over `libcuda.so.1` (no CUDA runtime needed).

use serde_json::Value;
use tessera_sim_testkit::SimNode;
use tessera_tests::{GIB, MIB, h100, json_u64 as u, run_python_json, shim};

const SHARED: u64 = 64 * MIB;

const PROGRAM: &str = r#"
import ctypes, json, socket, subprocess, sys
from ctypes import byref, c_int, c_uint, c_size_t, c_void_p, c_ulonglong, c_ubyte

cu = ctypes.CDLL("libcuda.so.1")
class Prop(ctypes.Structure):
    _fields_ = [("type", c_uint), ("handleTypes", c_uint), ("locType", c_uint), ("locId", c_int),
                ("win32", c_void_p), ("flags", c_ubyte * 8)]
class Access(ctypes.Structure):
    _fields_ = [("locType", c_uint), ("locId", c_int), ("flags", c_uint)]
POSIX_FD, PINNED, DEVICE, READ_WRITE = 1, 1, 1, 3
SIZE = 64 << 20

def ok(rc, what):
    if rc != 0:
        sys.exit(f"{what}: CUresult {rc}")

def start():
    ok(cu.cuInit(0), "cuInit")
    dev, ctx = c_int(), c_void_p()
    ok(cu.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
    ok(cu.cuCtxCreate_v2(byref(ctx), 0, dev), "cuCtxCreate")

def free():
    f, t = c_size_t(), c_size_t()
    ok(cu.cuMemGetInfo_v2(byref(f), byref(t)), "cuMemGetInfo")
    return f.value, t.value

def map_handle(h):
    ptr = c_ulonglong()
    ok(cu.cuMemAddressReserve(byref(ptr), c_size_t(SIZE), c_size_t(0), c_ulonglong(0), c_ulonglong(0)), "reserve")
    ok(cu.cuMemMap(ptr, c_size_t(SIZE), c_size_t(0), c_ulonglong(h), c_ulonglong(0)), "cuMemMap")
    access = Access(DEVICE, 0, READ_WRITE)
    ok(cu.cuMemSetAccess(ptr, c_size_t(SIZE), byref(access), c_size_t(1)), "cuMemSetAccess")
    return ptr.value

def unmap(ptr, h):
    ok(cu.cuMemUnmap(c_ulonglong(ptr), c_size_t(SIZE)), "cuMemUnmap")
    ok(cu.cuMemRelease(c_ulonglong(h)), "cuMemRelease")
    ok(cu.cuMemAddressFree(c_ulonglong(ptr), c_size_t(SIZE)), "cuMemAddressFree")

def read(ptr, n):
    buf = (c_ubyte * n)()
    ok(cu.cuMemcpyDtoH_v2(buf, c_ulonglong(ptr), c_size_t(n)), "cuMemcpyDtoH")
    return list(buf)

def write(ptr, data):
    buf = (c_ubyte * len(data))(*data)
    ok(cu.cuMemcpyHtoD_v2(c_ulonglong(ptr), buf, c_size_t(len(data))), "cuMemcpyHtoD")

def create(handle_types):
    h = c_ulonglong()
    ok(cu.cuMemCreate(byref(h), c_size_t(SIZE), byref(Prop(PINNED, handle_types, DEVICE, 0)), c_ulonglong(0)), "cuMemCreate")
    return h.value

out = {}
if sys.argv[1] == "export":
    start()
    out["free_start"], out["total"] = free()
    h = create(POSIX_FD)
    ptr = map_handle(h)
    write(ptr, range(16))
    fd = c_int(-1)
    ok(cu.cuMemExportToShareableHandle(byref(fd), c_ulonglong(h), POSIX_FD, c_ulonglong(0)), "export")
    out["exporter_free"] = free()[0]
    # An allocation not made exportable cannot be exported.
    private = create(0)
    out["export_private"] = cu.cuMemExportToShareableHandle(byref(c_int()), c_ulonglong(private), POSIX_FD, c_ulonglong(0))
    ok(cu.cuMemRelease(c_ulonglong(private)), "release private")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], "import", str(theirs.fileno())],
                             pass_fds=[theirs.fileno()], stdout=subprocess.PIPE, text=True)
    theirs.close()
    socket.send_fds(ours, [b"h"], [fd.value])
    stdout, _ = child.communicate()
    if child.returncode != 0:
        sys.exit("importer failed: " + stdout)
    out.update(json.loads(stdout.strip().splitlines()[-1]))
    out["exporter_sees"] = read(ptr + SIZE - 16, 16)
    out["exporter_free_after_import"] = free()[0]
    unmap(ptr, h)
    out["exporter_free_end"] = free()[0]
else:
    start()
    sock = socket.socket(fileno=int(sys.argv[2]))
    _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    out["importer_free_before"] = free()[0]
    h = c_ulonglong()
    ok(cu.cuMemImportFromShareableHandle(byref(h), c_void_p(fds[0]), POSIX_FD), "import")
    prop = Prop()
    ok(cu.cuMemGetAllocationPropertiesFromHandle(byref(prop), h), "properties")
    out["imported_props"] = [prop.type, prop.handleTypes, prop.locType, prop.locId]
    ptr = map_handle(h.value)
    out["importer_sees"] = read(ptr, 16)
    write(ptr + SIZE - 16, [7] * 16)
    out["importer_free"] = free()[0]
    # A file that is no allocation of this driver is refused.
    with open("/dev/null") as f:
        out["import_foreign"] = cu.cuMemImportFromShareableHandle(byref(c_ulonglong()), c_void_p(f.fileno()), POSIX_FD)
    unmap(ptr, h.value)
    out["importer_free_end"] = free()[0]
print(json.dumps(out))
"#;

fn run(node: &SimNode, extra: &[(&str, &str)]) -> Value {
    run_python_json(node, "python3", "the program", &["-c", PROGRAM, "export", PROGRAM], extra)
}

/// What both runs show: the bytes cross, foreign and private handles are refused.
fn check_sharing(v: &Value) {
    assert_eq!(v["importer_sees"], serde_json::json!((0..16).collect::<Vec<_>>()), "the exporter's bytes");
    assert_eq!(v["exporter_sees"], serde_json::json!(vec![7; 16]), "the importer's bytes");
    assert_eq!(v["imported_props"], serde_json::json!([1, 1, 1, 0]), "pinned, fd-shareable, on device 0: {v}");
    assert_eq!(u(v, "export_private"), 1, "CUDA_ERROR_INVALID_VALUE: not made exportable");
    assert_eq!(u(v, "import_foreign"), 1, "CUDA_ERROR_INVALID_VALUE: not an allocation of this driver");
}

#[test]
fn processes_share_a_physical_allocation_counted_once() {
    let node = SimNode::new();
    let v = run(&node, &[]);
    check_sharing(&v);
    let board = h100::MEMORY - h100::RESERVED;
    assert_eq!(u(&v, "exporter_free"), board - h100::CONTEXT_OVERHEAD - SHARED);
    // The importer's context and the one shared allocation; importing and mapping take nothing.
    assert_eq!(u(&v, "importer_free_before"), board - 2 * h100::CONTEXT_OVERHEAD - SHARED);
    assert_eq!(u(&v, "importer_free"), u(&v, "importer_free_before"), "importing charges nothing");
    assert_eq!(u(&v, "importer_free_end"), u(&v, "importer_free_before"), "nor does letting go of it");
    assert_eq!(u(&v, "exporter_free_after_import"), board - h100::CONTEXT_OVERHEAD - SHARED, "the importer has exited");
    assert_eq!(u(&v, "exporter_free_end"), board - h100::CONTEXT_OVERHEAD, "freed once, by its owner");
}

#[test]
fn under_the_shim_the_importer_is_not_charged() {
    let node = SimNode::new();
    let shim = shim();
    let v = run(&node, &[("LD_PRELOAD", shim.to_str().expect("utf-8 path")), ("TESSERA_MEMORY_LIMIT", "1GiB")]);
    check_sharing(&v);
    assert_eq!(u(&v, "total"), GIB, "the limit shows as the device's memory");
    assert_eq!(u(&v, "exporter_free"), GIB - h100::CONTEXT_OVERHEAD - SHARED, "the exporter is charged");
    assert_eq!(u(&v, "importer_free"), u(&v, "importer_free_before"), "the importer is not charged again");
    assert_eq!(u(&v, "importer_free_end"), u(&v, "importer_free_before"), "nor refunded what it never paid");
    assert_eq!(u(&v, "exporter_free_end"), GIB - h100::CONTEXT_OVERHEAD);
}
