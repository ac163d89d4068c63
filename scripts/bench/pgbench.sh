#!/usr/bin/env bash
# Postgres TPC-B (pgbench) on a Keel volume and on a local directory, side by side
# (BENCHMARKS.md). The volume path is NBD → nbdfuse → loop device → mkfs.ext4 → mount; the
# baseline is a directory on a local filesystem. Both clusters run synchronous_commit=on.
# Called by `keel bench pgbench` (which embeds this file) or directly.
#
# Usage: pgbench.sh [--nbd nbd://HOST:PORT/EXPORT] [--local-dir DIR] [--scale N]
#                   [--clients N] [--threads N] [--seconds N] [--work-dir DIR]
# Needs root and Debian packages: postgresql (initdb, pg_ctl, pgbench), libnbd-bin (nbdfuse),
# fuse3, mount (losetup), e2fsprogs (mkfs.ext4). The volume's contents are destroyed.
set -euo pipefail

nbd_uri=""
local_dir=/var/tmp/keel-pgbench
work_dir=/var/tmp/keel-pgbench-nbd
scale=50
clients=8
threads=2
seconds=60
port_base=54390
while [ $# -gt 0 ]; do
  case "$1" in
    --nbd) nbd_uri=$2; shift 2 ;;
    --local-dir) local_dir=$2; shift 2 ;;
    --work-dir) work_dir=$2; shift 2 ;;
    --scale) scale=$2; shift 2 ;;
    --clients) clients=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    *) echo "pgbench.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

need() { command -v "$1" >/dev/null 2>&1 || { echo "pgbench.sh: $1 is missing (Debian package $2)" >&2; exit 1; }; }
pg_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
[ -n "$pg_bin" ] && [ -x "$pg_bin/initdb" ] || { echo "pgbench.sh: initdb is missing (Debian package postgresql)" >&2; exit 1; }
need pgbench postgresql-client
need runuser util-linux
if [ -n "$nbd_uri" ]; then
  need nbdfuse libnbd-bin
  need losetup mount
  need mkfs.ext4 e2fsprogs
  [ "$(id -u)" = 0 ] || { echo "pgbench.sh: the NBD setup needs root (loop device, mount)" >&2; exit 1; }
fi

cleanup_steps=()
# Undo steps, run in reverse order on exit (each may already be done: failures are ignored).
cleanup() {
  for (( index=${#cleanup_steps[@]}-1; index>=0; index-- )); do
    eval "${cleanup_steps[$index]}" 2>/dev/null || true
  done
}
trap cleanup EXIT

as_postgres() { runuser -u postgres -- "$@"; }

# run_pgbench NAME DIRECTORY PORT → appends "NAME TPS LATENCY_MS" to $results_file.
run_pgbench() {
  local name=$1 directory=$2 port=$3
  local data=$directory/data socket=$directory/socket
  mkdir -p "$directory" "$socket"
  rm -rf "$data"
  chown -R postgres: "$directory"
  echo "[$name] $(stat -f -c %T "$directory") under $directory" >&2
  as_postgres "$pg_bin/initdb" -A trust -D "$data" >/dev/null
  as_postgres "$pg_bin/pg_ctl" -D "$data" -l "$directory/postgres.log" -w \
    -o "-p $port -k $socket -c listen_addresses='' -c synchronous_commit=on -c fsync=on" start >/dev/null
  cleanup_steps+=("as_postgres '$pg_bin/pg_ctl' -D '$data' -m fast -w stop >/dev/null")
  as_postgres pgbench -q -h "$socket" -p "$port" -i -s "$scale" postgres >/dev/null 2>&1
  local output
  output=$(as_postgres pgbench -h "$socket" -p "$port" -c "$clients" -j "$threads" -T "$seconds" postgres 2>&1)
  as_postgres "$pg_bin/pg_ctl" -D "$data" -m fast -w stop >/dev/null
  local tps latency
  tps=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' <<<"$output" | tail -1)
  latency=$(sed -n 's/^latency average = \([0-9.]*\) ms/\1/p' <<<"$output")
  if [ -z "$tps" ]; then
    echo "pgbench.sh: [$name] pgbench printed no TPS:" >&2
    echo "$output" >&2
    exit 1
  fi
  echo "[$name] $tps TPS, latency average $latency ms" >&2
  echo "$name $tps $latency" >>"$results_file"
}

results_file=$(mktemp)
cleanup_steps+=("rm -f '$results_file'")
run_pgbench local "$local_dir" $port_base

if [ -n "$nbd_uri" ]; then
  fuse_dir=$work_dir/fuse
  mount_dir=$work_dir/mnt
  mkdir -p "$fuse_dir" "$mount_dir"
  nbdfuse "$fuse_dir" "$nbd_uri" &
  nbdfuse_pid=$!
  cleanup_steps+=("kill $nbdfuse_pid; wait $nbdfuse_pid")
  for _ in $(seq 100); do [ -e "$fuse_dir/nbd" ] && break; sleep 0.1; done
  [ -e "$fuse_dir/nbd" ] || { echo "pgbench.sh: nbdfuse did not expose $fuse_dir/nbd" >&2; exit 1; }
  cleanup_steps+=("fusermount3 -u '$fuse_dir' 2>/dev/null || umount '$fuse_dir'")
  loop=$(losetup --direct-io=on --find --show "$fuse_dir/nbd")
  cleanup_steps+=("losetup -d $loop")
  mkfs.ext4 -q -F "$loop"
  mount "$loop" "$mount_dir"
  cleanup_steps+=("umount '$mount_dir'")
  run_pgbench keel-volume "$mount_dir/pg" $((port_base + 1))
fi

printf '\npgbench -i -s %s; pgbench -c %s -j %s -T %s; synchronous_commit=on\n' "$scale" "$clients" "$threads" "$seconds"
printf '| setup | TPS | latency average (ms) |\n| --- | ---: | ---: |\n'
while read -r name tps latency; do
  printf '| %s | %s | %s |\n' "$name" "$tps" "$latency"
done <"$results_file"
