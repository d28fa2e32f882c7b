#!/usr/bin/env bash
# Runs every test of the workspace on a fresh machine: system packages, build, tests.
# The tests drive the simulated node through its driver library and the workspace's programs,
# so everything is built first (cargo test alone builds only what each test binary links).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cargo build --workspace --all-targets
cargo test --workspace "$@"
