#!/usr/bin/env bash
# Keel's whole test suite, as the README gives it and CI runs it:
#   1. install the test clients (Debian packages, pytest/boto3),
#   2. build everything once (release profile, shared by every suite below),
#   3. formatting and clippy gates,
#   4. the Rust tests (unit, property, crash, corruption, full-disk, protocol, fuzz-style),
#   5. the end-to-end suites: the real `keel` binary on loopback with real clients
#      (qemu-io, fio, nbdcopy, nbdfuse + ext4 + Postgres; aws cli, boto3, rclone).
# Test data lives under target/ and /var/tmp (real filesystems), never tmpfs.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "scripts/test.sh needs root (loop devices, mounts, apt-get)" >&2
  exit 1
fi
bash scripts/install-deps.sh

export CARGO_TERM_COLOR=never
step() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

step "build (release, all targets)"
cargo build --release --workspace --all-targets --locked

step "format and lint gates"
cargo fmt --all -- --check
(cd sim && cargo fmt -- --check)
cargo clippy --release --workspace --all-targets --locked -- -D warnings
(cd sim && cargo clippy --release --all-targets --locked -- -D warnings)

# Both suites run even when the first fails, so one run reports every failure.
set +e
step "rust tests"
cargo test --release --workspace --locked --no-fail-fast
rust_status=$?

# The store and namespace again in a debug build, so overflow checks and debug_assert!s run on
# the code that holds the data.
step "store and namespace tests (debug build)"
cargo test --locked --no-fail-fast -p keel-store -p keel-namespace
debug_status=$?
if [ "$debug_status" != 0 ]; then rust_status=$debug_status; fi

# The deterministic cluster simulation: its own workspace and target dir (it builds
# keel-cluster with the `simulation` feature and tokio with --cfg tokio_unstable). A slice of
# seeds here; the long mode is `cd sim && cargo run --release --bin keel-sim -- --minutes N`.
step "cluster simulation (a slice of seeds)"
(cd sim && cargo test --release --locked)
sim_status=$?
if [ "$sim_status" != 0 ]; then rust_status=$sim_status; fi

step "end-to-end tests"
export KEEL_BIN="$PWD/target/release/keel"
mkdir -p /var/tmp/keel-e2e
# The tests' data goes here; a passing test removes its own. How full the disk was explains a
# run that failed for want of room.
df -h /var/tmp "$PWD/target"
python3 -m pytest -q -p no:cacheprovider tests/ "$@"
e2e_status=$?
set -e

if [ "$e2e_status" = 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  e2e_status=1
fi
if [ "$rust_status" != 0 ] || [ "$e2e_status" != 0 ]; then
  echo "FAILED: rust tests exit $rust_status, end-to-end tests exit $e2e_status" >&2
  exit 1
fi
echo "all test suites passed"
