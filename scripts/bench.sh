#!/usr/bin/env bash
# Runs the benchmarks on demand (never part of the tests): builds the release libraries and
# programs the benchmarks load, then runs criterion. Pass a bench name to run one.
#
# `scripts/bench.sh kube`: claim created -> container running on the real cluster of
# `scripts/kube.sh` (started for the run when none is up, and taken down after), tesserad beside
# NVIDIA's DRA driver, which is built here from its Go module (cached under target/kube/nvidia,
# never committed); TESSERA_BENCH_NO_NVIDIA=1 leaves it out.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cargo build --workspace --release

# NVIDIA's DRA driver: the version, and the container toolkit's CDI hook its specs name (the
# version its go.mod pins).
nvidia_dra_version=v0.5.0
nvidia_toolkit_version=v1.20.0

# Builds NVIDIA's kubelet plugin and CDI hook once; prints the directory holding them.
build_nvidia_dra() {
  local out=target/kube/nvidia/$nvidia_dra_version src dir dest
  if [[ -x $out/gpu-kubelet-plugin && -x $out/nvidia-cdi-hook ]]; then
    echo "$out"
    return
  fi
  echo "bench.sh: building NVIDIA's DRA driver $nvidia_dra_version (its kubelet plugin) and CDI hook $nvidia_toolkit_version" >&2
  export GOWORK=off GOTOOLCHAIN=local GOSUMDB=off GOFLAGS="-mod=mod -buildvcs=false"
  src=target/kube/src/dra-driver-nvidia-gpu@$nvidia_dra_version
  rm -rf "$src" "$out.tmp"
  mkdir -p "$(dirname "$src")" "$out.tmp"
  dir=$(go mod download -json "sigs.k8s.io/dra-driver-nvidia-gpu@$nvidia_dra_version" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  [[ -n $dir && -d $dir ]] || { echo "bench.sh: go mod download sigs.k8s.io/dra-driver-nvidia-gpu@$nvidia_dra_version failed" >&2; exit 1; }
  cp -r "$dir" "$src"
  chmod -R u+w "$src"
  # Its go.mod names a Kubernetes release candidate the module proxy does not serve: the
  # release kube.sh builds instead (its libraries stay at the versions the driver names).
  (cd "$src" && go mod edit -replace k8s.io/kubernetes=k8s.io/kubernetes@v1.37.2)
  # go-nvfm (the fabric manager's bindings, for GPU passthrough on NVSwitch systems) is not
  # served either: its client answers with the package's own stub, which whole GPUs never reach.
  rm -f "$src/pkg/fabricmanager/client_nvfm_test.go"
  printf '%s\n' 'package fabricmanager' '' 'func NewClient(string, ConnectParams) Client { return NewStubClient() }' \
    >"$src/pkg/fabricmanager/client_nvfm.go"
  # go-nvml opens libnvidia-ml.so.1 at run time (cgo, symbols resolved then).
  dest=$PWD/$out.tmp/
  (cd "$src" && CGO_ENABLED=1 CGO_LDFLAGS_ALLOW='-Wl,--unresolved-symbols=ignore-in-object-files' \
    go build -trimpath -ldflags="-s -w" -o "$dest" ./cmd/gpu-kubelet-plugin)
  dir=$(go mod download -json "github.com/NVIDIA/nvidia-container-toolkit@$nvidia_toolkit_version" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  [[ -n $dir && -d $dir ]] || { echo "bench.sh: go mod download github.com/NVIDIA/nvidia-container-toolkit@$nvidia_toolkit_version failed" >&2; exit 1; }
  (cd "$dir" && CGO_ENABLED=1 CGO_LDFLAGS_ALLOW='-Wl,--unresolved-symbols=ignore-in-object-files' \
    go build -trimpath -ldflags="-s -w" -o "$dest" ./cmd/nvidia-cdi-hook)
  [[ -x $dest/gpu-kubelet-plugin && -x $dest/nvidia-cdi-hook ]] || { echo "bench.sh: NVIDIA's DRA driver did not build" >&2; exit 1; }
  rm -rf "$out"
  mv "$out.tmp" "$out"
  echo "$out"
}

if [[ ${1:-} == kube ]]; then
  shift
  if [[ ${TESSERA_BENCH_NO_NVIDIA:-} != 1 ]]; then
    nv=$(build_nvidia_dra) || exit 1
    export TESSERA_BENCH_NVIDIA_PLUGIN=$PWD/$nv/gpu-kubelet-plugin TESSERA_BENCH_NVIDIA_CDI_HOOK=$PWD/$nv/nvidia-cdi-hook
  fi
  started=0
  if ! scripts/kube.sh env >/dev/null 2>&1; then
    scripts/kube.sh up
    started=1
  fi
  status=0
  cargo bench -p tessera-tests --bench kube "$@" || status=$?
  if ((started)); then scripts/kube.sh down; fi
  exit "$status"
fi

# `scripts/bench.sh control_path`: tesserad beside NVIDIA's device plugin on the simulated node
# with the test kubelet (daemon/benches/control_path.rs). The plugin is built here from its Go
# module once (cached under target/kube/nvidia, never committed).
nvidia_device_plugin_version=v0.19.1

# Builds NVIDIA's nvidia-device-plugin once; prints the directory holding it.
build_nvidia_device_plugin() {
  local out=target/kube/nvidia/k8s-device-plugin@$nvidia_device_plugin_version src dir dest
  if [[ -x $out/nvidia-device-plugin ]]; then
    echo "$out"
    return
  fi
  echo "bench.sh: building NVIDIA's device plugin $nvidia_device_plugin_version" >&2
  export GOWORK=off GOTOOLCHAIN=local GOSUMDB=off GOFLAGS="-mod=mod -buildvcs=false"
  src=target/kube/src/k8s-device-plugin@$nvidia_device_plugin_version
  rm -rf "$src" "$out.tmp"
  mkdir -p "$(dirname "$src")" "$out.tmp"
  dir=$(go mod download -json "github.com/NVIDIA/k8s-device-plugin@$nvidia_device_plugin_version" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  [[ -n $dir && -d $dir ]] || { echo "bench.sh: go mod download github.com/NVIDIA/k8s-device-plugin@$nvidia_device_plugin_version failed" >&2; exit 1; }
  cp -r "$dir" "$src"
  chmod -R u+w "$src"
  # go-nvml opens libnvidia-ml.so.1 at run time (cgo, symbols resolved then).
  dest=$PWD/$out.tmp/
  (cd "$src" && CGO_ENABLED=1 CGO_LDFLAGS_ALLOW='-Wl,--unresolved-symbols=ignore-in-object-files' \
    go build -trimpath -ldflags="-s -w" -o "$dest" ./cmd/nvidia-device-plugin)
  rm -rf "$out"
  mv "$out.tmp" "$out"
  echo "$out"
}

if [[ ${1:-} == control_path ]]; then
  shift
  nv=$(build_nvidia_device_plugin) || exit 1
  export TESSERA_BENCH_NVIDIA_DEVICE_PLUGIN=$PWD/$nv/nvidia-device-plugin
  exec cargo bench -p tessera-daemon --bench control_path "$@"
fi

if [[ $# -gt 0 ]]; then
  cargo bench --workspace --bench "$@"
else
  cargo bench --workspace
fi
