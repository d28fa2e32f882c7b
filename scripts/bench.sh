#!/usr/bin/env bash
# Runs the benchmarks on demand (never part of the tests): builds the release libraries and
# programs the benchmarks load, then runs criterion. Pass a bench name to run one.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cargo build --workspace --release
if [[ $# -gt 0 ]]; then
  cargo bench --workspace --bench "$@"
else
  cargo bench --workspace
fi
