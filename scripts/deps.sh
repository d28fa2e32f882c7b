#!/usr/bin/env bash
# Installs the system packages Tessera's build and tests need, when they are missing.
# Debian/Ubuntu (apt) only; elsewhere it names what to install and goes on.
set -euo pipefail

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
install_zigbuild

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
