#!/usr/bin/env bash
# Runs every test of the workspace on a fresh machine: system packages, build, tests.
# The tests drive the simulated node through its driver library and the workspace's programs,
# so everything is built first (cargo test alone builds only what each test binary links).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cargo build --workspace --all-targets
# The shipped libtessera.so, linked against glibc 2.17 (a test reads the symbol versions it needs).
cargo zigbuild -p tessera-shim --release --target x86_64-unknown-linux-gnu.2.17 --target-dir target/glibc-2.17
# The static hook and wrapper hosts get (a runc test runs them).
scripts/build-static-hook.sh >/dev/null
cargo test --workspace "$@"
