#!/usr/bin/env bash
# Runs Tessera's main job on this machine: tesserad discovers the GPUs through NVML and applies the
# declared partitions (`--once`: the summary, then exit; without it tesserad serves the kubelet). With no
# NVIDIA driver present it runs on the simulated node (the built-in 8 x H100 node, or the
# description in $TESSERA_SIM_NODE), shows a workload on it, and prints the node's state.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cargo build --workspace --release --quiet
bin=target/release
if ldconfig -p 2>/dev/null | grep -q 'libnvidia-ml.so.1 '; then
  echo "tessera: NVIDIA driver found (libnvidia-ml.so.1)" >&2
  exec "$bin/tesserad" "$@"
fi
echo "tessera: no NVIDIA driver found; using the simulated node (${TESSERA_SIM_NODE:-built-in 8 x H100-SXM5-80GB})" >&2
lib_dir=${TESSERA_SIM_LIB_DIR:-${XDG_RUNTIME_DIR:-/tmp}/tessera-sim-lib}
"$bin/tessera-sim" install "$lib_dir" >/dev/null
"$bin/tesserad" --sim --once "$@"
# A workload through the driver ABI, to show the node at work, then the node's state.
LD_LIBRARY_PATH="$lib_dir" "$bin/tessera-workload" --alloc-mib 2048 --kernels 50 --kernel-us 2000 --depth 4
exec "$bin/tessera-sim" status
