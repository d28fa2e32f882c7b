#!/usr/bin/env bash
# tessera-hook and tessera-runtime as static PIE binaries, for hosts: no dynamic loader work at
# each container start (they run once per start; docs/hook.md, "Where a start's time goes") and
# no dependence on the host's glibc. Needs glibc's static libraries (Debian: libc6-dev).
# Prints the directory they are in: target/static/x86_64-unknown-linux-gnu/release.
set -euo pipefail
cd "$(dirname "$0")/.."
# With --target, RUSTFLAGS reach only the target's crates, not build scripts or proc macros.
RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --quiet --target x86_64-unknown-linux-gnu \
  --target-dir target/static -p tessera-hook --bins
out=target/static/x86_64-unknown-linux-gnu/release
for b in tessera-hook tessera-runtime; do
  if LC_ALL=C readelf -lW "$out/$b" | grep -q 'INTERP'; then
    echo "build-static-hook: $out/$b still names a dynamic loader" >&2
    exit 1
  fi
done
echo "$out"
