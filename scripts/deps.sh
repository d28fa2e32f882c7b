#!/usr/bin/env bash
# Installs the system packages Tessera's build and tests need, when they are missing.
# Debian/Ubuntu (apt) only; elsewhere it names what to install and goes on.
#
#   scripts/deps.sh          what the build and every test need (scripts/test.sh, CI)
#   scripts/deps.sh --main   only what building and running Tessera needs (scripts/run.sh): no
#                            runtimes, frameworks or tools that only the tests use
set -euo pipefail
main_only=0
case ${1:-} in
  --main) main_only=1 ;;
  "") ;;
  *) echo "usage: $0 [--main]  (--main: only what scripts/run.sh needs; got '$1')" >&2; exit 2 ;;
esac

# Package : a command or file that shows it is installed.
PACKAGES=(
  "gcc:gcc"
  "libc6-dev:/usr/include/stdio.h"
  "pkg-config:pkg-config"
  # daemon/tests/prometheus.rs scrapes tesserad's /metrics with a real Prometheus server.
  "prometheus:prometheus"
  # hook/tests/: real runtimes run busybox containers with the hook and the runtime wrapper.
  "runc:runc"
  "podman:podman"
  "containerd:containerd"
  "busybox-static:/bin/busybox"
  # daemon/tests/deploy.rs: `systemd-analyze verify` of deploy/systemd/tesserad.service.
  "systemd:systemd-analyze"
  # daemon/tests/deploy.rs: `kubectl kustomize` renders deploy/kubernetes (Debian: kubernetes-client).
  "kubernetes-client:kubectl"
  # scripts/kube.sh (the real cluster of tests/flows/kube_cluster.rs): the pods' network (bridge,
  # host-local, loopback), the cluster's certificates. Kubernetes, etcd and containerd are built
  # from their Go modules by kube.sh itself.
  "containernetworking-plugins:/usr/lib/cni/bridge"
  "openssl:openssl"
  # scripts/kube.sh asks the scheduler and the controller-manager for their /healthz, and gives
  # the node an address on the loopback interface.
  "curl:curl"
  "iproute2:ip"
  # scripts/kube.sh: the kubernetes Service's DNAT to the API server (pods' in-cluster access).
  "iptables:iptables"
)

# cargo-zigbuild (it brings zig) builds the shipped libtessera.so against glibc 2.17, the oldest
# glibc a container may have (scripts/test.sh builds it; a test checks its symbol versions).
install_zigbuild() {
  command -v cargo-zigbuild >/dev/null 2>&1 && return 0
  local pip
  pip=$(command -v pip3 || command -v pip || true)
  if [[ -z $pip ]]; then
    echo "deps: please install cargo-zigbuild (pip install cargo-zigbuild)" >&2
    return 0
  fi
  echo "deps: installing cargo-zigbuild (pip)" >&2
  "$pip" install --quiet cargo-zigbuild || "$pip" install --quiet --user cargo-zigbuild ||
    echo "deps: pip could not install cargo-zigbuild; please install it" >&2
}
# The build's own needs (the first three packages) are all that --main installs.
if [[ $main_only == 1 ]]; then
  PACKAGES=("${PACKAGES[@]:0:3}")
else
install_zigbuild

# Python tools some tests run, each in a virtual environment of the build (never system-wide):
# install_venv DIR "IMPORT CHECK" PACKAGE... makes DIR and installs the packages unless the check
# (python code run in DIR) already passes.
install_venv() {
  local venv=$1 check=$2
  shift 2
  if [[ -x $venv/bin/python ]] && "$venv/bin/python" -c "$check" 2>/dev/null; then
    return 0
  fi
  if ! command -v python3 >/dev/null 2>&1; then
    echo "deps: please install python3 (for $*)" >&2
    return 0
  fi
  if ! python3 -m venv "$venv" 2>/dev/null; then
    # Debian splits venv out of python3.
    if command -v apt-get >/dev/null 2>&1; then
      local sudo=""
      [[ $(id -u) -ne 0 ]] && sudo="sudo"
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends python3-venv
    fi
    python3 -m venv "$venv" || { echo "deps: python3 -m venv failed; please install python3-venv" >&2; return 0; }
  fi
  echo "deps: installing $* into $venv" >&2
  "$venv/bin/pip" install --quiet "$@" || echo "deps: pip could not install $* into $venv" >&2
}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# tests/flows/cuda_runtime_programs.rs runs CuPy over the simulated node: NVIDIA's CUDA runtime
# and NVRTC from their wheels (TESSERA_CUDA_RUNTIMES, else target/cuda-runtimes). Pinned: the
# sim is tested against these runtimes.
install_venv "${TESSERA_CUDA_RUNTIMES:-$root/target/cuda-runtimes}" \
  "import cupy, cupy_backends, importlib.metadata as m; assert m.version('cupy-cuda12x') == '14.2.0'" \
  "cupy-cuda12x==14.2.0" "nvidia-cuda-runtime-cu12==12.9.79" "nvidia-cuda-nvrtc-cu12==12.9.86"

# tests/flows/cuda_runtime_programs.rs runs PyTorch 2.8 (the CUDA 12.8 build) over the simulated
# node (TESSERA_TORCH_RUNTIME, else target/torch-runtime). Trimmed: torch without its dependency
# resolution, plus only the NVIDIA libraries libtorch_cuda.so links against and the Python modules
# `import torch` needs (about 5.3 GB installed, 3.4 GB downloaded; the full install, with
# cuSOLVER, NVRTC, NVTX and Triton, is 6.5 GB). TESSERA_NO_TORCH=1 skips it (the PyTorch tests then
# print a SKIP line, or fail under TESSERA_REQUIRE_RUNTIMES).
# It is large: with less than 14 GB free where it goes (the build and the tests still need about
# 4 GB after it), it is not installed, and why is written beside it (<venv>.skipped), so that the
# tests say so in their SKIP line rather than fail a machine that cannot hold it.
# room_for VENV CHECK GB WHAT SIZE: whether a large environment may be installed at VENV: it is
# there already (CHECK passes in it), or GB are free where it goes; else why not (WHAT, SIZE) is
# said and written to VENV.skipped.
room_for() {
  local venv=$1 check=$2 gb=$3 what=$4 size=$5 free_kb
  [[ -x $venv/bin/python ]] && "$venv/bin/python" -c "$check" 2>/dev/null && return 0
  mkdir -p "$(dirname "$venv")"
  free_kb=$(df -Pk "$(dirname "$venv")" | awk 'NR == 2 {print $4}')
  ((free_kb >= gb * 1024 * 1024)) && return 0
  echo "$what not installed: only $((free_kb / 1024 / 1024)) GB free at $(dirname "$venv"), it needs $gb GB ($size)" |
    tee "$venv.skipped" >&2
  return 1
}
torch_venv=${TESSERA_TORCH_RUNTIME:-$root/target/torch-runtime}
rm -f "$torch_venv.skipped"
if [[ ${TESSERA_NO_TORCH:-0} != 1 ]] &&
  room_for "$torch_venv" "import torch" 14 PyTorch "5.3 GB installed plus the build"; then
  # No pip cache: it would keep another 3.4 GB of wheels.
  PIP_NO_CACHE_DIR=1 install_venv "$torch_venv" \
    "import torch; assert torch.__version__ == '2.8.0+cu128'" \
    --no-deps "torch==2.8.0" \
    "nvidia-cuda-runtime-cu12==12.8.90" "nvidia-cuda-cupti-cu12==12.8.90" "nvidia-cublas-cu12==12.8.4.1" \
    "nvidia-cudnn-cu12==9.10.2.21" "nvidia-cufft-cu12==11.3.3.83" "nvidia-curand-cu12==10.3.9.90" \
    "nvidia-cusparse-cu12==12.5.8.93" "nvidia-cusparselt-cu12==0.7.1" "nvidia-nccl-cu12==2.27.3" \
    "nvidia-nvjitlink-cu12==12.8.93" "nvidia-cufile-cu12==1.13.1.3" \
    filelock typing-extensions sympy mpmath networkx jinja2 MarkupSafe fsspec
fi

# tests/flows/jax_programs.rs runs JAX 0.10.2 with its CUDA 12 plugin over the simulated node
# (TESSERA_JAX_RUNTIME, else target/jax-runtime). jaxlib is built against CUDA 12.9, cuBLAS 12.9.1
# and cuDNN 9.8: the NVIDIA libraries are the CUDA 12.9 update 1 ones (the runtime and NVRTC those
# of target/cuda-runtimes), cuDNN the one PyTorch pins (>= 9.8). Trimmed as PyTorch is: no
# dependency resolution, only what the plugin's start-up check loads (runtime, cuBLAS, cuDNN,
# cuFFT, cuPTI, cuSPARSE and its nvJitLink), NVRTC (cuDNN's) and ptxas (nvcc's wheel: XLA
# compiles its kernels with it); not cuSOLVER, NCCL or NVSHMEM, which XLA loads only for linear
# algebra and collectives (about 4.1 GB installed, 2.2 GB downloaded). TESSERA_NO_JAX=1 skips it.
# As PyTorch: with less than 10 GB free where it goes (4.1 GB installed, the wheels unpacked on
# the way, and the build and tests after it), it is not installed and <venv>.skipped says why.
jax_venv=${TESSERA_JAX_RUNTIME:-$root/target/jax-runtime}
rm -f "$jax_venv.skipped"
jax_check="import jax, jax_plugins.xla_cuda12, jax_cuda12_plugin; assert jax.__version__ == '0.10.2'"
if [[ ${TESSERA_NO_JAX:-0} != 1 ]] &&
  room_for "$jax_venv" "$jax_check" 10 JAX "4.1 GB installed plus the build"; then
  PIP_NO_CACHE_DIR=1 install_venv "$jax_venv" "$jax_check" \
    --no-deps "jax==0.10.2" "jaxlib==0.10.2" "jax-cuda12-plugin==0.10.2" "jax-cuda12-pjrt==0.10.2" \
    "ml_dtypes==0.7.0" "numpy==2.4.6" "scipy==1.17.1" "opt_einsum==3.4.0" \
    "nvidia-cuda-runtime-cu12==12.9.79" "nvidia-cuda-nvrtc-cu12==12.9.86" "nvidia-cuda-nvcc-cu12==12.9.86" \
    "nvidia-cublas-cu12==12.9.1.4" "nvidia-cuda-cupti-cu12==12.9.79" "nvidia-cudnn-cu12==9.10.2.21" \
    "nvidia-cufft-cu12==11.4.1.4" "nvidia-cusparse-cu12==12.5.10.65" "nvidia-nvjitlink-cu12==12.9.86"
fi
# Both pin the same cuDNN (1 GB): the identical files become one (util-linux's hardlink; the
# copies differ only in their times).
if command -v hardlink >/dev/null 2>&1 && [[ -d $torch_venv/lib && -d $jax_venv/lib ]]; then
  hardlink --quiet --ignore-time "$torch_venv/lib" "$jax_venv/lib" >/dev/null 2>&1 || true
fi

# daemon/tests/deploy.rs validates the rendered Kubernetes manifests against the 1.34 and 1.37
# schemas with kubernetes-validate.
install_venv "$root/target/k8s-validate" "import kubernetes_validate" kubernetes-validate

# daemon/tests/monitoring.rs regenerates the Grafana dashboard (grafanalib) and checks the alert
# rules and their tests (PyYAML); deploy/monitoring/picture.py draws docs/images/dashboard.png
# (matplotlib). TESSERA_MONITORING_PYTHON names another Python with them. (promtool, which the
# same test runs, comes with the prometheus package above.)
install_venv "$root/target/monitoring" \
  "import grafanalib, yaml, matplotlib, importlib.metadata as m; assert m.version('grafanalib') == '0.7.1'" \
  "grafanalib==0.7.1" "attrs==26.1.0" "pyyaml==6.0.3" "matplotlib==3.11.2" "numpy==2.4.6"

# tests/flows/stock_grpc_clients.rs runs the Python example client (examples/python) with stock
# grpcio, its modules generated from proto/ by grpcio-tools (TESSERA_GRPC_PYTHON, else
# target/grpc-python).
install_venv "${TESSERA_GRPC_PYTHON:-$root/target/grpc-python}" "import grpc, grpc_tools" \
  "grpcio==1.85.1" "grpcio-tools==1.85.1"

# daemon/tests/deploy.rs renders the Helm chart (deploy/helm/tessera) with Helm v4, built from its
# Go module into target/helm (nothing prebuilt can be fetched; about 3 minutes on 2 cores, once).
helm_dir=$root/target/helm/v4.3.2
if [[ ! -x $helm_dir/helm ]]; then
  if command -v go >/dev/null 2>&1; then
    echo "deps: building Helm v4.3.2 from helm.sh/helm/v4 into $helm_dir" >&2
    GOBIN=$helm_dir GOTOOLCHAIN=local GOFLAGS="-trimpath -buildvcs=false" CGO_ENABLED=0 \
      go install -ldflags="-s -w" helm.sh/helm/v4/cmd/helm@v4.3.2 ||
      echo "deps: Helm could not be built (go install helm.sh/helm/v4/cmd/helm@v4.3.2, above)" >&2
  else
    echo "deps: please install Go to build Helm (the Helm chart tests need it)" >&2
  fi
fi
fi

missing=()
for entry in "${PACKAGES[@]}"; do
  pkg=${entry%%:*}
  probe=${entry#*:}
  if [[ $probe == /* ]]; then [[ -e $probe ]] && continue; else command -v "$probe" >/dev/null 2>&1 && continue; fi
  missing+=("$pkg")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
  echo "deps: please install: ${missing[*]}" >&2
  exit 0
fi
sudo=""
[[ $(id -u) -ne 0 ]] && sudo="sudo"
echo "deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
