#!/usr/bin/env bash
# Builds Tessera's container image (deploy/image/Containerfile) offline with podman: the
# programs from this repository's build and the shared libraries they need, FROM scratch.
#
#   scripts/build-image.sh [--tag NAME] [--profile release|debug] [--no-build]
#
# --profile debug uses target/debug (what the tests built); --no-build uses what is there.
# What the installer copies onto hosts is built against glibc 2.17 (cargo zigbuild, as
# scripts/test.sh builds the shim), so that it runs on any host's glibc: the shim, and
# tessera-hook and tessera-runtime when their 2.17 builds exist (else this build's, with a
# warning). TESSERA_IMAGE_SHIM names another libtessera.so. Prints the image name last.
set -euo pipefail
cd "$(dirname "$0")/.."

tag=localhost/tessera:0.1.0
profile=release
build=1
while [[ $# -gt 0 ]]; do
  case $1 in
    --tag) tag=$2; shift 2 ;;
    --profile) profile=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    *) echo "build-image: unknown argument $1 (expected --tag NAME, --profile release|debug, --no-build)" >&2; exit 2 ;;
  esac
done
case $profile in release | debug) ;; *) echo "build-image: --profile must be release or debug, not $profile" >&2; exit 2 ;; esac
command -v podman >/dev/null || { echo "build-image: podman is not installed (Debian package podman)" >&2; exit 1; }

glibc_217=target/glibc-2.17/x86_64-unknown-linux-gnu/release
shim_217=$glibc_217/libtessera.so
if [[ $build == 1 ]]; then
  flag=(); [[ $profile == release ]] && flag=(--release)
  cargo build "${flag[@]}" -p tessera-daemon -p tessera-hook --bins
  cargo zigbuild -p tessera-shim -p tessera-hook --release --target x86_64-unknown-linux-gnu.2.17 \
    --target-dir target/glibc-2.17
fi
shim=${TESSERA_IMAGE_SHIM:-$shim_217}
[[ -f $shim ]] || { echo "build-image: $shim is missing: build the glibc-2.17 shim (scripts/test.sh shows how) or set TESSERA_IMAGE_SHIM" >&2; exit 1; }

bins=(tesserad tessera tessera-hook tessera-runtime)
ctx=target/image/context
rm -rf "$ctx"
mkdir -p "$ctx/rootfs/usr/local/bin" "$ctx/rootfs/usr/local/lib/tessera" "$ctx/rootfs/etc/tessera" "$ctx/rootfs/tmp"
chmod 1777 "$ctx/rootfs/tmp"
for b in "${bins[@]}"; do
  src=target/$profile/$b
  if [[ $b == tessera-hook || $b == tessera-runtime ]]; then
    if [[ -x $glibc_217/$b ]]; then
      src=$glibc_217/$b
    else
      echo "build-image: warning: no glibc-2.17 $b; the image's runs only on hosts with this machine's glibc or newer" >&2
    fi
  fi
  [[ -x $src ]] || { echo "build-image: $src is missing: build it (or drop --no-build)" >&2; exit 1; }
  install -m 0755 "$src" "$ctx/rootfs/usr/local/bin/$b"
done
install -m 0644 "$shim" "$ctx/rootfs/usr/local/lib/tessera/libtessera.so"
# Debug information is not shipped (the release profile keeps some for the build's own use).
if command -v strip >/dev/null; then
  strip --strip-debug "$ctx"/rootfs/usr/local/bin/* "$ctx/rootfs/usr/local/lib/tessera/libtessera.so"
fi

# The libraries the programs load, at the paths the loader looks for them; and glibc's libraries
# that the driver's libnvidia-ml.so.1 (dlopened from the host's driver root) needs.
libs=$(for b in "${bins[@]}"; do ldd "$ctx/rootfs/usr/local/bin/$b"; done |
  awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $1 ~ /ld-linux/ {print $1}' | sort -u)
libdir=$(dirname "$(ldd "target/$profile/tesserad" | awk '/libc.so.6/ {print $3}')")
for extra in libdl.so.2 libpthread.so.0 librt.so.1 libm.so.6; do
  [[ -e $libdir/$extra ]] && libs+=$'\n'"$libdir/$extra"
done
for lib in $libs; do
  mkdir -p "$ctx/rootfs$(dirname "$lib")"
  cp -L "$lib" "$ctx/rootfs$lib"
done
# /lib64 -> the loader, as glibc's programs name it.
if [[ ! -e $ctx/rootfs/lib64/ld-linux-x86-64.so.2 ]]; then
  loader=$(ldd "target/$profile/tesserad" | awk '/ld-linux/ {print $1}')
  mkdir -p "$ctx/rootfs/lib64"
  cp -L "$loader" "$ctx/rootfs/lib64/ld-linux-x86-64.so.2"
fi

cp deploy/image/Containerfile "$ctx/Containerfile"
podman build --pull=never --network=none -t "$tag" -f "$ctx/Containerfile" "$ctx" >&2
echo "$tag"
