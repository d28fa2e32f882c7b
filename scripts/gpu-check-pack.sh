#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh needs into .gpu-check/ (git-ignored), for a GPU machine with
# no Rust toolchain: libtessera.so built for glibc 2.17 and the workload.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cargo build --release -p tessera-workload
cargo zigbuild --release -p tessera-shim --target x86_64-unknown-linux-gnu.2.17 --target-dir target/glibc-2.17
mkdir -p .gpu-check
cp target/glibc-2.17/x86_64-unknown-linux-gnu/release/libtessera.so target/release/tessera-workload .gpu-check/
echo .gpu-check
