#!/usr/bin/env bash
# Runs every test of the workspace on a fresh machine: system packages, build, tests.
# The tests drive the simulated node through its driver library and the workspace's programs,
# so everything is built first (cargo test alone builds only what each test binary links).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
# Beside the test environments deps.sh put in target/, the builds, the clusters and the tests'
# files take about 6 GB more there (and Go's caches several GB outside it, the first time). On
# a disk with less left a linker dies of a bus error mid-build, which names nothing: said here
# first (a warning; the run goes on).
mkdir -p target
free_gb=$(($(df -Pk target | awk 'NR == 2 {print $4}') / 1024 / 1024))
if ((free_gb < 10)); then
  echo "test: only ${free_gb} GB free for target/; the builds and tests need about 6 GB, more the first time." >&2
  echo "test: free some space (an old target/, ~/.cache), or a linker may fail with a bus error." >&2
fi
cargo build --workspace --all-targets
# The shipped libtessera.so, linked against glibc 2.17 (a test reads the symbol versions it needs).
cargo zigbuild -p tessera-shim --release --target x86_64-unknown-linux-gnu.2.17 --target-dir target/glibc-2.17
# The static hook and wrapper hosts get (a runc test runs them).
scripts/build-static-hook.sh >/dev/null
# Every test but the real cluster's, which run after, alone (so that the cluster's components
# take no CPU from the others' measurements): tests/flows/kube_cluster.rs and kube_park.rs leave them to the run
# below while TESSERA_KUBE_DEFERRED is set.
TESSERA_KUBE_DEFERRED=1 cargo test --workspace "$@"
# A real single-node Kubernetes cluster for tests/flows/kube_cluster.rs (scripts/kube.sh: built
# from the Go modules on first use, about 27 minutes on 2 cores, and cached under target/kube/;
# docs/kubernetes.md). Without one (no root, no Go) those tests print SKIP, or fail when
# TESSERA_REQUIRE_RUNTIMES is set. TESSERA_NO_KUBE=1 leaves them out.
if [[ ${TESSERA_NO_KUBE:-0} != 1 ]]; then
  if scripts/kube.sh up; then
    trap 'scripts/kube.sh down' EXIT
  elif [[ -n ${TESSERA_REQUIRE_RUNTIMES:-} ]]; then
    echo "test: TESSERA_REQUIRE_RUNTIMES is set, but the Kubernetes cluster did not start (scripts/kube.sh up, above)" >&2
    exit 1
  else
    echo "test: no Kubernetes cluster (scripts/kube.sh up failed, above): the kube_cluster tests will SKIP" >&2
  fi
  cargo test -p tessera-tests --test kube_cluster --test kube_park
  # The same tests on Kubernetes 1.34 (`--version 1.34`: the older ResourceSlice layout, the DRA
  # features behind alpha gates; its build adds about 21 minutes on 2 cores the first time).
  # TESSERA_NO_KUBE_1_34=1 leaves this run out.
  if [[ ${TESSERA_NO_KUBE_1_34:-0} != 1 ]]; then
    scripts/kube.sh down
    if scripts/kube.sh --version 1.34 up; then
      cargo test -p tessera-tests --test kube_cluster --test kube_park
    elif [[ -n ${TESSERA_REQUIRE_RUNTIMES:-} ]]; then
      echo "test: TESSERA_REQUIRE_RUNTIMES is set, but the Kubernetes 1.34 cluster did not start (scripts/kube.sh --version 1.34 up, above)" >&2
      exit 1
    fi
  fi
fi
