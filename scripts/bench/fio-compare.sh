#!/usr/bin/env bash
# Cross-checks keel bench against fio on the same file in the same run: the sync-qd1 and
# randrw-qd64 profiles (BENCHMARKS.md), each tool alternately, ROUNDS times, RUNTIME seconds
# each, then prints IOPS and p50/p99 (total latency: submission to completion) side by side
# with the ratio keel/fio. Needs: fio (Debian package fio), python3, a keel-bench binary.
#
# Usage: scripts/bench/fio-compare.sh [--file PATH] [--rounds N] [--runtime SECONDS]
#                                     [--size SIZE] [--keel-bench COMMAND] [--out DIR]
#                                     [--profiles "sync-qd1 randrw-qd64"]
# Default keel-bench command: target/release/examples/keel-bench (build it with
# `cargo build --release -p keel-bench --example keel-bench`), or set KEEL_BENCH="keel bench".
set -euo pipefail

file=/var/tmp/keel-fio-compare.dat
rounds=3
runtime=10
size=1G
out=/var/tmp/keel-fio-compare
keel_bench=${KEEL_BENCH:-target/release/examples/keel-bench}
profiles="sync-qd1 randrw-qd64"
while [ $# -gt 0 ]; do
  case "$1" in
    --file) file=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --runtime) runtime=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --keel-bench) keel_bench=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --profiles) profiles=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
command -v fio >/dev/null || { echo "fio is missing: apt-get install fio" >&2; exit 1; }
command -v python3 >/dev/null || { echo "python3 is missing: apt-get install python3" >&2; exit 1; }
mkdir -p "$out"
echo "target file: $file ($(stat -f -c %T "$(dirname "$file")"))"
for device in /sys/block/*/queue/write_cache; do echo "  $device: $(cat "$device")"; done

# Lay the file out once with random data so both tools overwrite allocated blocks.
$keel_bench run --profile seq-read --target "$file" --size "$size" --runtime-seconds 1 >/dev/null

fio_common=(--filename="$file" --size="$size" --runtime="$runtime" --time_based
            --ioengine=libaio --direct=1 --bs=4k --lat_percentiles=1 --output-format=json)
run_fio() {  # PROFILE ROUND
  case "$1" in
    # --sync=dsync (O_DSYNC), what keel's sync-qd1 uses; BENCHMARKS.md's --sync=1 is O_SYNC,
    # which also commits the inode's timestamps and so measures a little more than data.
    sync-qd1) fio --name=sync-qd1 "${fio_common[@]}" --sync=dsync --rw=write --numjobs=1 \
                --iodepth=1 >"$out/fio-sync-qd1-$2.json" ;;
    randrw-qd64) fio --name=randrw-qd64 "${fio_common[@]}" --randrepeat=1 --iodepth=64 \
                   --readwrite=randrw --rwmixread=75 >"$out/fio-randrw-qd64-$2.json" ;;
  esac
}
run_keel() {  # PROFILE ROUND
  $keel_bench run --profile "$1" --target "$file" --size "$size" \
    --runtime-seconds "$runtime" --json "$out/keel-$1-$2.json" >/dev/null
}
for round in $(seq 1 "$rounds"); do
  echo "round $round/$rounds"
  for profile in $profiles; do
    # Alternate which tool goes first, so a disk that changes speed over time (or is still
    # writing back the previous run) does not favour one of them.
    if [ $((round % 2)) = 1 ]; then
      run_fio "$profile" "$round"; run_keel "$profile" "$round"
    else
      run_keel "$profile" "$round"; run_fio "$profile" "$round"
    fi
  done
done

python3 - "$out" "$rounds" "$profiles" <<'PYTHON'
import json, statistics, sys
out, rounds, profiles = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()

def fio(path, kind):
    job = json.load(open(path))["jobs"][0][kind]
    percentiles = job["lat_ns"]["percentile"]
    return job["iops"], percentiles["50.000000"] / 1e3, percentiles["99.000000"] / 1e3

def keel(path, kind):
    result = json.load(open(path))["results"][0]
    stats = result["reads" if kind == "read" else "writes"]
    return stats["iops"], stats["latency"]["p50_us"], stats["latency"]["p99_us"]

print("| profile | op | round | fio IOPS | keel IOPS | ratio | fio p50 µs | keel p50 µs | ratio | fio p99 µs | keel p99 µs | ratio |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
medians = {}
for profile, kinds in (("sync-qd1", ["write"]), ("randrw-qd64", ["read", "write"])):
    if profile not in profiles:
        continue
    for kind in kinds:
        ratios = [[], [], []]
        for round_ in range(1, rounds + 1):
            f = fio(f"{out}/fio-{profile}-{round_}.json", kind)
            k = keel(f"{out}/keel-{profile}-{round_}.json", kind)
            row = []
            for index in range(3):
                ratio = k[index] / f[index] if f[index] else float("nan")
                ratios[index].append(ratio)
                row += [f"{f[index]:.0f}" if index == 0 else f"{f[index]:.1f}",
                        f"{k[index]:.0f}" if index == 0 else f"{k[index]:.1f}", f"{ratio:.3f}"]
            print(f"| {profile} | {kind} | {round_} | " + " | ".join(row) + " |")
        medians[(profile, kind)] = [statistics.median(r) for r in ratios]
print()
print("| profile | op | median keel/fio IOPS | p50 | p99 |")
print("| --- | --- | ---: | ---: | ---: |")
for (profile, kind), (iops, p50, p99) in medians.items():
    print(f"| {profile} | {kind} | {iops:.3f} | {p50:.3f} | {p99:.3f} |")
PYTHON
