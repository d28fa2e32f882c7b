//! Two processes of the node share one physical allocation through the driver's shareable
//! handles (`cuMemExportToShareableHandle` / `cuMemImportFromShareableHandle` with
//! `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, the file descriptor passed over a unix socket, as
//! PyTorch's expandable segments share memory between processes): the importer reads what the
//! exporter wrote and the exporter reads the importer's answer. The memory lives while any
//! process holds a handle to it or maps it (cuda.h, `cuMemRelease`), so each holder is charged
//! it: by the driver (NVML's per-process figure, which tesserad's enforcement reads) from its
//! `cuMemCreate` or import, and under libtessera.so for what it maps, refused past its limit.
//! Before, the importer was charged nothing and memory its exporter had let go of was charged
//! to no one: a container held 8 GiB under a 2 GiB share, and no event was raised.
//!
//! The programs are Python's ctypes over `libcuda.so.1` (no CUDA runtime needed).

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::Stdio;

use serde_json::Value;
use tessera_sim_testkit::SimNode;
use tessera_tests::{CUDA_PY, GIB, MIB, h100, json_u64 as u, run_python_json, shim};

const SHARED: u64 = 64 * MIB;

/// Follows [`CUDA_PY`].
const PROGRAM: &str = r#"
import json, socket, subprocess
SIZE = 64 << 20

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
    let program = format!("{CUDA_PY}{PROGRAM}");
    run_python_json(node, "python3", "the program", &["-c", &program, "export", &program], extra)
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
fn processes_share_a_physical_allocation_each_holder_charged() {
    let node = SimNode::new();
    let v = run(&node, &[]);
    check_sharing(&v);
    let board = h100::MEMORY - h100::RESERVED;
    assert_eq!(u(&v, "exporter_free"), board - h100::CONTEXT_OVERHEAD - SHARED);
    // The importer's context and the one shared allocation, charged to its exporter.
    assert_eq!(u(&v, "importer_free_before"), board - 2 * h100::CONTEXT_OVERHEAD - SHARED);
    // The importer holds it too: charged to it as well while it does (NVML lists it with it).
    assert_eq!(u(&v, "importer_free"), u(&v, "importer_free_before") - SHARED, "the importer is charged");
    assert_eq!(u(&v, "importer_free_end"), u(&v, "importer_free_before"), "until it lets go of it");
    assert_eq!(u(&v, "exporter_free_after_import"), board - h100::CONTEXT_OVERHEAD - SHARED, "the importer has exited");
    assert_eq!(u(&v, "exporter_free_end"), board - h100::CONTEXT_OVERHEAD, "freed once, by its owner");
}

#[test]
fn under_the_shim_the_importer_is_charged_what_it_maps() {
    let node = SimNode::new();
    let shim = shim();
    let v = run(&node, &[("LD_PRELOAD", shim.to_str().expect("utf-8 path")), ("TESSERA_MEMORY_LIMIT", "1GiB")]);
    check_sharing(&v);
    assert_eq!(u(&v, "total"), GIB, "the limit shows as the device's memory");
    assert_eq!(u(&v, "exporter_free"), GIB - h100::CONTEXT_OVERHEAD - SHARED, "the exporter is charged");
    assert_eq!(u(&v, "importer_free"), u(&v, "importer_free_before") - SHARED, "the importer is charged what it maps");
    assert_eq!(u(&v, "importer_free_end"), u(&v, "importer_free_before"), "until it unmaps and releases it");
    assert_eq!(u(&v, "exporter_free_end"), GIB - h100::CONTEXT_OVERHEAD);
}

// ---- Memory an exporter lets go of ------------------------------------------------------------

/// The exporter makes `N` allocations of `SIZE_MIB`, exports each, and lets go of it at once
/// (unmapped and released: under the shim it pays nothing more); it hands the descriptors over a
/// unix socket at `argv[2]` and stays until the importer hangs up. The importer imports and maps
/// each (a map refused: its handle released), prints what it got, waits for a line on stdin
/// (while the test reads the driver's figures), then lets go of everything.
/// Follows [`CUDA_PY`].
const ESCAPE: &str = r#"
import json, os, socket, time
N, SIZE = int(os.environ["N"]), int(os.environ["SIZE_MIB"]) << 20

def reserve():
    ptr = c_ulonglong()
    ok(cu.cuMemAddressReserve(byref(ptr), c_size_t(SIZE), c_size_t(0), c_ulonglong(0), c_ulonglong(0)), "reserve")
    return ptr.value

def access(ptr):
    a = Access(DEVICE, 0, READ_WRITE)
    ok(cu.cuMemSetAccess(c_ulonglong(ptr), c_size_t(SIZE), byref(a), c_size_t(1)), "cuMemSetAccess")

out = {"pid": os.getpid()}
if sys.argv[1] == "export":
    start()
    out["free_start"] = free()[0]
    fds = []
    for i in range(N):
        h = c_ulonglong()
        ok(cu.cuMemCreate(byref(h), c_size_t(SIZE), byref(Prop(PINNED, POSIX_FD, DEVICE, 0)), c_ulonglong(0)), "cuMemCreate")
        ptr = reserve()
        ok(cu.cuMemMap(c_ulonglong(ptr), c_size_t(SIZE), c_size_t(0), h, c_ulonglong(0)), "cuMemMap")
        access(ptr)
        mark = (c_ubyte * 16)(*([i + 1] * 16))
        ok(cu.cuMemcpyHtoD_v2(c_ulonglong(ptr), mark, c_size_t(16)), "cuMemcpyHtoD")
        fd = c_int(-1)
        ok(cu.cuMemExportToShareableHandle(byref(fd), h, POSIX_FD, c_ulonglong(0)), "export")
        fds.append(fd.value)
        ok(cu.cuMemUnmap(c_ulonglong(ptr), c_size_t(SIZE)), "cuMemUnmap")
        ok(cu.cuMemRelease(h), "cuMemRelease")
        ok(cu.cuMemAddressFree(c_ulonglong(ptr), c_size_t(SIZE)), "cuMemAddressFree")
    out["free_after_letting_go"] = free()[0]
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sys.argv[2])
    srv.listen(1)
    conn, _ = srv.accept()
    socket.send_fds(conn, [b"h"], fds)
    for fd in fds:
        os.close(fd)
    conn.recv(1)
    print(json.dumps(out))
else:
    start()
    free()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for _ in range(6000):
        try:
            sock.connect(sys.argv[2])
            break
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.01)
    _, fds, _, _ = socket.recv_fds(sock, 16, N)
    maps, seen, held = [], [], []
    for fd in fds:
        h = c_ulonglong()
        ok(cu.cuMemImportFromShareableHandle(byref(h), c_void_p(fd), POSIX_FD), "import")
        os.close(fd)
        ptr = reserve()
        rc = cu.cuMemMap(c_ulonglong(ptr), c_size_t(SIZE), c_size_t(0), h, c_ulonglong(0))
        maps.append(rc)
        if rc == 0:
            access(ptr)
            buf = (c_ubyte * 16)()
            ok(cu.cuMemcpyDtoH_v2(buf, c_ulonglong(ptr), c_size_t(16)), "cuMemcpyDtoH")
            seen.append(buf[0])
            held.append((ptr, h))
        else:
            ok(cu.cuMemRelease(h), "cuMemRelease (refused)")
            ok(cu.cuMemAddressFree(c_ulonglong(ptr), c_size_t(SIZE)), "cuMemAddressFree (refused)")
    out.update({"maps": maps, "seen": seen, "free": free()[0]})
    print(json.dumps(out), flush=True)
    sock.close()
    sys.stdin.readline()
    for ptr, h in held:
        ok(cu.cuMemUnmap(c_ulonglong(ptr), c_size_t(SIZE)), "cuMemUnmap")
        ok(cu.cuMemRelease(h), "cuMemRelease")
        ok(cu.cuMemAddressFree(c_ulonglong(ptr), c_size_t(SIZE)), "cuMemAddressFree")
    # A memory query reaps exited processes of the container at most every 100 ms.
    time.sleep(0.2)
    print(json.dumps({"free_end": free()[0]}))
"#;

const PIECES: u64 = 4;
const PIECE: u64 = 256 * MIB;

/// What the driver said while the importer held its pieces, the exporter gone.
struct Held {
    /// The importer's report: its maps' results, the marks it read, its free memory (the shim's).
    importer: Value,
    /// NVML's per-process figure for the importer (what tesserad's enforcement reads).
    importer_nvml: u64,
    /// The device's used memory.
    device_used: u64,
    /// The importer's free memory after letting go of everything.
    importer_free_end: u64,
}

/// Runs the exporter and the importer under the shim with a 1 GiB limit each, in the regions
/// given (one path: one container; two: two containers).
fn escape(node: &SimNode, exporter_region: &Path, importer_region: &Path) -> Held {
    let shim = shim();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("fds");
    let sock = sock.to_str().unwrap();
    let spawn = |role: &str, region: &Path| {
        node.command("python3")
            .args(["-c", &format!("{CUDA_PY}{ESCAPE}"), role, sock])
            .env("LD_PRELOAD", &shim)
            .env("TESSERA_MEMORY_LIMIT", "1GiB")
            .env("TESSERA_REGION", region)
            .env("N", PIECES.to_string())
            .env("SIZE_MIB", (PIECE / MIB).to_string())
            .env_remove("CUDA_VISIBLE_DEVICES")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("python3")
    };
    let exporter = spawn("export", exporter_region);
    let mut importer = spawn("import", importer_region);
    let mut lines = BufReader::new(importer.stdout.take().unwrap()).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    let exported = exporter.wait_with_output().unwrap();
    assert!(exported.status.success(), "the exporter: {}", String::from_utf8_lossy(&exported.stderr));
    let Ok(report) = serde_json::from_str::<Value>(&first) else {
        let out = importer.wait_with_output().unwrap();
        panic!("the importer: {first}\n{}", String::from_utf8_lossy(&out.stderr));
    };
    // The exporter is gone: the importer alone holds the pieces it mapped.
    let model = tessera_sim_model::Node::open_state(&node.state, None).unwrap();
    let procs = model.processes(0, None).unwrap();
    let pid = u(&report, "pid") as u32;
    let importer_nvml = procs.iter().find(|p| p.pid == pid).map_or(0, |p| p.used_bytes);
    let device_used = model.memory_info(0, 0).unwrap().used;
    importer.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let last = lines.next().and_then(Result::ok).unwrap_or_default();
    let out = importer.wait_with_output().unwrap();
    assert!(out.status.success(), "the importer: {last}\n{}", String::from_utf8_lossy(&out.stderr));
    let end: Value = serde_json::from_str(&last).unwrap_or_else(|e| panic!("{e}: {last}"));
    Held { importer: report, importer_nvml, device_used, importer_free_end: u(&end, "free_end") }
}

/// Each held piece is the exporter's memory, readable by the importer; what it holds is charged
/// to it alike by the shim and by the driver, and the device still holds it, the exporter gone.
fn check_held(h: &Held, maps: &[u64], charged_to_container: u64) {
    let v = &h.importer;
    let got: Vec<u64> = v["maps"].as_array().unwrap().iter().map(|m| m.as_u64().unwrap()).collect();
    assert_eq!(got, maps, "0: mapped; 2: CUDA_ERROR_OUT_OF_MEMORY, the driver not called: {v}");
    let mapped = maps.iter().filter(|&&m| m == 0).count() as u64;
    let marks: Vec<u64> = (1..=mapped).collect();
    assert_eq!(v["seen"], serde_json::json!(marks), "each piece holds what its exporter wrote");
    let own = h100::CONTEXT_OVERHEAD + mapped * PIECE;
    assert_eq!(h.importer_nvml, own, "NVML charges the importer its context and every piece it holds");
    assert_eq!(h.device_used, own, "the pieces live on after their exporter let go and exited");
    assert_eq!(u(v, "free"), GIB - charged_to_container, "the shim's figure for the importer's container");
    assert_eq!(h.importer_free_end, GIB - h100::CONTEXT_OVERHEAD, "refunded once it let go");
}

/// Two containers of 1 GiB: the exporter's lets go of four 256 MiB pieces; the importer's pays
/// for those it maps, three beside its context, and the fourth is refused. Before, all four
/// mapped and nobody paid for them: NVML showed the importer with its context alone.
#[test]
fn memory_an_exporter_lets_go_of_is_charged_to_the_importing_container() {
    let node = SimNode::new();
    let dir = tempfile::tempdir().unwrap();
    let h = escape(&node, &dir.path().join("region-a"), &dir.path().join("region-b"));
    check_held(&h, &[0, 0, 0, 2], h100::CONTEXT_OVERHEAD + 3 * PIECE);
    assert_eq!(h.importer_nvml, GIB, "the driver's figure is the shim's: the limit, not past it");
}

/// One container of 1 GiB: with the exporter's context still there, the importer maps two
/// pieces and is refused the other two. Before, it mapped all four: 1.5 GiB held in the 1 GiB
/// container.
#[test]
fn memory_shared_inside_one_container_counts_against_its_limit() {
    let node = SimNode::new();
    let dir = tempfile::tempdir().unwrap();
    let region = dir.path().join("region");
    let h = escape(&node, &region, &region);
    check_held(&h, &[0, 0, 2, 2], 2 * h100::CONTEXT_OVERHEAD + 2 * PIECE);
}
