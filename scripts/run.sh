#!/usr/bin/env bash
# Runs Tessera's main job on this machine: tesserad discovers the GPUs through NVML and applies the
# declared partitions (`--once`: the summary, then exit; without it tesserad serves the kubelet). With no
# NVIDIA driver present it asks for the simulated node (--sim) (the built-in 8 x H100 node, or the
# description in $TESSERA_SIM_NODE), shows a workload on it, and prints the node's state.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh --main
cargo build --workspace --release --quiet
bin=target/release
if ldconfig -p 2>/dev/null | grep -q 'libnvidia-ml.so.1 '; then
  echo "tessera: NVIDIA driver found (libnvidia-ml.so.1)" >&2
  exec "$bin/tesserad" "$@"
fi
echo "tessera: no NVIDIA driver found; running tesserad --sim, the simulated node (${TESSERA_SIM_NODE:-built-in 8 x H100-SXM5-80GB}); tesserad itself never picks it alone" >&2
lib_dir=${TESSERA_SIM_LIB_DIR:-${XDG_RUNTIME_DIR:-/tmp}/tessera-sim-lib}
"$bin/tessera-sim" install "$lib_dir" >/dev/null
"$bin/tesserad" --sim --once "$@"
# A workload through the driver ABI, to show the node at work, then the node's state.
LD_LIBRARY_PATH="$lib_dir" "$bin/tessera-workload" --alloc-mib 2048 --kernels 50 --kernel-us 2000 --depth 4
"$bin/tessera-sim" status

# The daemon serving: GPU 0 split into 4 shares, the node API on a socket of its own; the CLI
# shows the node, re-partitions GPU 1 into MIG instances (an H100 switches MIG mode in place, so
# the first apply does it all and the second finds nothing to change), and lists the events;
# then SIGTERM.
demo=$(mktemp -d)
# Each region is a tmpfs of its own (as root): detach what is mounted under the demo, then remove it.
cleanup() {
  kill "${daemon:-}" 2>/dev/null || true
  awk -v d="$demo/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
  rm -rf "$demo"
}
trap cleanup EXIT
# A driver root of the simulated node (device nodes, proc tree, libraries), so the CDI specs name
# real files, as on a host with a driver.
"$bin/tessera-sim" install --driver-root "$demo/driver" >/dev/null
cat >"$demo/config.toml" <<EOF
sim = true
device_plugin_dir = "$demo/plugins"
state_dir = "$demo/state"
runtime_dir = "$demo/run"
[injection]
driver_root = "$demo/driver"
dev_root = "$demo/driver/dev"
[partitions."0"]
shares = { count = 4 }
EOF
"$bin/tesserad" --config "$demo/config.toml" 2>"$demo/tesserad.log" &
daemon=$!
for _ in $(seq 100); do [[ -S $demo/run/tessera.sock ]] && break; sleep 0.05; done
cli() { echo "\$ tessera $*" >&2; "$bin/tessera" --socket "$demo/run/tessera.sock" "$@"; }
cli status
cli layout apply --gpu 1 --mig 3g.40gb=2 || true
cli layout apply --gpu 1 --mig 3g.40gb=2 || true
cli events --replay 20
# Leave the simulated GPU 1 as it was for the next run: whole again (MIG off, in place).
"$bin/tessera" --socket "$demo/run/tessera.sock" layout apply --gpu 1 --whole >/dev/null || true
kill -TERM "$daemon" && wait "$daemon"
"$bin/tessera-sim" reset --gpu 1 >/dev/null
