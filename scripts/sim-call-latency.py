#!/usr/bin/env python3
"""The H200 reference's call-latency probe, run against whichever libcuda.so.1 and
libnvidia-ml.so.1 the loader finds (the sim: LD_LIBRARY_PATH at a `tessera-sim install` directory
or a testkit node's lib/, TESSERA_SIM_STATE at its state file, TESSERA_SIM_LATENCY on or off).

Mean of 200 calls (50 for utilization) from ctypes, one process, device 0, as
shared/reference/h200-facts.json's measured_call_latency_us. Prints one line, microseconds.
docs/benchmarks.md, "A real driver's call latency".
"""
import ctypes
import time

cu = ctypes.CDLL("libcuda.so.1")
nv = ctypes.CDLL("libnvidia-ml.so.1")
assert cu.cuInit(0) == 0, "cuInit"
ctx = ctypes.c_void_p()
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0, "cuDevicePrimaryCtxRetain"
assert cu.cuCtxSetCurrent(ctx) == 0, "cuCtxSetCurrent"
assert nv.nvmlInit_v2() == 0, "nvmlInit_v2"
dev = ctypes.c_void_p()
assert nv.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev)) == 0, "nvmlDeviceGetHandleByIndex_v2"

free, total, n = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_uint()
memory = (ctypes.c_ulonglong * 3)()
infos = (ctypes.c_ulonglong * (6 * 256))()  # room for 256 nvmlProcessInfo_t (v3: 48 bytes)
samples = (ctypes.c_ulonglong * (4 * 256))()  # room for 256 nvmlProcessUtilizationSample_t


def processes():
    n.value = 256
    return nv.nvmlDeviceGetComputeRunningProcesses_v3(dev, ctypes.byref(n), infos)


def utilization():
    n.value = 256
    return nv.nvmlDeviceGetProcessUtilization(dev, samples, ctypes.byref(n), ctypes.c_ulonglong(0))


CALLS = [
    ("cuMemGetInfo_v2", lambda: cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), 200),
    ("nvmlDeviceGetComputeRunningProcesses_v3", processes, 200),
    ("nvmlDeviceGetCount_v2", lambda: nv.nvmlDeviceGetCount_v2(ctypes.byref(n)), 200),
    ("nvmlDeviceGetMemoryInfo", lambda: nv.nvmlDeviceGetMemoryInfo(dev, memory), 200),
    ("nvmlDeviceGetProcessUtilization", utilization, 50),
]

out = []
for name, call, times in CALLS:
    call()
    start = time.perf_counter()
    for _ in range(times):
        call()
    out.append("%s %.2f" % (name, (time.perf_counter() - start) / times * 1e6))
print(" | ".join(out))
