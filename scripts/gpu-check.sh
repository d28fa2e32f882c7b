#!/usr/bin/env bash
# The real-GPU check of libtessera.so: one short script (well under 5 minutes) for a machine
# with an NVIDIA GPU and driver. It only reads the card's settings; it never changes MIG mode,
# clocks, power or compute mode, and never resets the GPU.
#
# Usage: scripts/gpu-check.sh [ARTIFACTS]
#   ARTIFACTS: a folder holding libtessera.so and tessera-workload built elsewhere (see
#   scripts/gpu-check-pack.sh; the GPU machine may have no Rust toolchain). Default: build here.
# Prints one line per check (PASS/FAIL/SKIP) and exits non-zero if any check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
art=${1:-}
if [[ -z $art ]]; then
  cargo build --release -p tessera-shim -p tessera-workload >&2 || exit 2
  art=target/release
fi
shim=$(realpath "$art/libtessera.so")
workload=$(realpath "$art/tessera-workload")
fails=0
check() { # name, condition-status, detail
  if [[ $2 == 0 ]]; then echo "PASS $1: $3"; else echo "FAIL $1: $3"; fails=$((fails + 1)); fi
}

echo "== the card (read-only)"
nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,mig.mode.current,compute_mode --format=csv,noheader || exit 2

limit_mib=4096
export TESSERA_MEMORY_LIMIT=${limit_mib}MiB
echo "== the workload under the shim, memory limit ${limit_mib} MiB, each lookup path"
for lookup in dlsym getprocaddress; do
  out=$(LD_PRELOAD=$shim "$workload" --lookup $lookup --alloc-mib $((limit_mib * 2)) --chunk-mib 512 | tail -1)
  total=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["mem_total"])' "$out")
  err=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["alloc_error"])' "$out")
  got=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["allocated_bytes"] >> 20)' "$out")
  [[ $total == $((limit_mib << 20)) ]]; check "$lookup: cuMemGetInfo total is the limit" $? "total=$total"
  [[ $err == CUDA_ERROR_OUT_OF_MEMORY && $got -le $limit_mib ]]; check "$lookup: allocation stops at the limit" $? "error=$err allocated=${got}MiB"
done

echo "== PyTorch under the shim"
if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  cat > /tmp/tessera-torch-check.py <<'PY'
import json, sys, time, torch
free, total = torch.cuda.mem_get_info()
oom = None
try:
    x = torch.empty(int(sys.argv[1]) * 2 * 2**20, dtype=torch.uint8, device="cuda")
    oom = False
except torch.OutOfMemoryError:
    oom = True
model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
data = torch.randn(256, 2048, device="cuda")
for _ in range(20):
    opt.zero_grad(); model(data).square().mean().backward(); opt.step()
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(300):
    opt.zero_grad(); model(data).square().mean().backward(); opt.step()
torch.cuda.synchronize()
print(json.dumps({"total": total, "oom": oom, "ms_per_step": (time.perf_counter() - t) / 300 * 1e3}))
PY
  base=$(env -u TESSERA_MEMORY_LIMIT python3 /tmp/tessera-torch-check.py 0 | tail -1)
  shimmed=$(LD_PRELOAD=$shim python3 /tmp/tessera-torch-check.py $limit_mib | tail -1)
  echo "without: $base"; echo "with:    $shimmed"
  python3 - "$base" "$shimmed" $limit_mib <<'PY'
import json, sys
b, s, lim = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
ok_total = s["total"] == lim << 20
print(("PASS" if ok_total else "FAIL") + f" torch: mem_get_info total is the limit: {s['total']}")
print(("PASS" if s["oom"] else "FAIL") + f" torch: a tensor twice the limit raises OutOfMemoryError")
print(f"INFO torch: training step {b['ms_per_step']:.3f} ms without, {s['ms_per_step']:.3f} ms with the shim: ratio {s['ms_per_step'] / b['ms_per_step']:.3f}")
sys.exit(0 if ok_total and s["oom"] else 1)
PY
  check "torch under the shim" $? "see above"
else
  echo "SKIP torch: not installed or no GPU visible to it"
fi
echo "== $fails failed"
exit $((fails > 0))
