#!/usr/bin/env python3
"""Send and receive throughput of a volume snapshot stream, on one node.

    python3 scripts/bench/stream.py [--gib 2] [--rounds 3] [--json out.json]

A volume of --gib GiB is written whole (fio, 1 MiB writes of fresh random data through NBD)
and snapshotted. Each round, in turn:
- send: `keel snapshot send` of the snapshot into /dev/null (the server reads every block and
  frames it; the CLI copies the HTTP body);
- read: the same volume read through NBD by fio (1 MiB sequential reads, 4 in flight): the
  reference for send, the same blocks through the block path;
- receive: the stream (sent once into a file) received by `keel snapshot receive` into a new
  volume (kept until the end: the data takes --gib GiB per round);
- disk: this disk's sequential write bandwidth (fio, 1 MiB direct writes, 8 in flight): the
  reference for receive; and, for context, its buffered write (1 MiB writes through the page
  cache and one fsync at the end, as a receive meets the disk: on this machine far lower, and
  moving with whatever writeback is pending).
Prints MiB/s medians with send / read and receive / disk, and the server's CPU seconds per GiB
sent and received; writes JSON with --json. `KEEL_BIN` picks the binary (alternate two runs to
compare builds). Data under /var/tmp (never tmpfs); the stream file takes --gib GiB more."""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "cluster"))
from keelcluster import KEEL_BIN, Cluster, fs_type  # noqa: E402

WORK = Path(os.environ.get("KEEL_BENCH_DIR", "/var/tmp/keel-bench-stream"))
MIB = 1 << 20


def cpu_seconds(node):
    """User + system CPU seconds the node's process has used so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{node.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def keel(node, *args, **kwargs):
    cmd = [os.environ.get("KEEL_BIN", KEEL_BIN), *args, "--admin", node.admin, "--token-dir", str(node.dir)]
    result = subprocess.run(cmd, env=node.env, timeout=1800, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {result.stderr}")
    return result


def fio_bw(args):
    result = subprocess.run(["fio", "--output-format=json", *args], capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"fio failed: {result.stdout[-2000:]}{result.stderr[-2000:]}")
    job = json.loads(result.stdout[result.stdout.index("{"):])["jobs"][0]
    return (job["read"]["bw_bytes"] + job["write"]["bw_bytes"]) / MIB


def timed(node, work):
    """(MiB/s for `size` bytes, server CPU seconds) of `work()`, which returns the byte count."""
    cpu = cpu_seconds(node)
    started = time.monotonic()
    size = work()
    took = time.monotonic() - started
    return size / MIB / took, cpu_seconds(node) - cpu


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    assert fs_type(WORK) not in ("tmpfs", "ramfs"), f"{WORK} is on {fs_type(WORK)}"
    size = args.gib << 30
    stream = WORK / "stream.bin"
    cluster = Cluster(WORK / "cluster")
    rounds = []
    try:
        node = cluster.add()
        uri = f"nbd://{node.host}:{node.nbd_port}/src"
        code, answer = node.api("POST", "/api/v1/volumes", {"name": "src", "size_bytes": size})
        assert code == 200, answer
        fio_bw(["--name=fill", "--ioengine=nbd", f"--uri={uri}", f"--size={size}", "--rw=write", "--bs=1m",
                "--iodepth=8", "--refill_buffers", "--end_fsync=1"])
        keel(node, "snapshot", "create", "src@s", capture_output=True)
        with open(stream, "wb") as out:
            keel(node, "snapshot", "send", "src@s", stdout=out, stderr=subprocess.PIPE)
        stream_bytes = stream.stat().st_size
        for round_index in range(args.rounds):
            def send():
                with open(os.devnull, "wb") as out:
                    keel(node, "snapshot", "send", "src@s", stdout=out, stderr=subprocess.PIPE)
                return size

            def receive():
                with open(stream, "rb") as inp:
                    keel(node, "snapshot", "receive", f"r{round_index}", stdin=inp, capture_output=True)
                return size

            send_mib_s, send_cpu = timed(node, send)
            read_mib_s = fio_bw(["--name=read", "--ioengine=nbd", f"--uri={uri}", f"--size={size}", "--rw=read",
                                 "--bs=1m", "--iodepth=4"])
            # Kept until the end: a deleted volume is erased in the background, which would
            # overlap the next round.
            receive_mib_s, receive_cpu = timed(node, receive)
            disk = WORK / "seq.dat"
            disk_mib_s = fio_bw(["--name=seq", f"--filename={disk}", "--rw=write", "--bs=1m", f"--size={size}",
                                 "--ioengine=libaio", "--direct=1", "--iodepth=8", "--end_fsync=1"])
            disk.unlink()
            buffered_mib_s = fio_bw(["--name=buffered", f"--filename={disk}", "--rw=write", "--bs=1m",
                                     f"--size={size}", "--ioengine=psync", "--end_fsync=1"])
            disk.unlink()
            result = {
                "send_mib_s": send_mib_s, "send_cpu_s_per_gib": send_cpu / args.gib,
                "read_mib_s": read_mib_s,
                "receive_mib_s": receive_mib_s, "receive_cpu_s_per_gib": receive_cpu / args.gib,
                "disk_write_mib_s": disk_mib_s, "disk_buffered_write_mib_s": buffered_mib_s,
            }
            rounds.append(result)
            print(f"round {round_index + 1}: " + ", ".join(f"{key} {value:.2f}" for key, value in result.items()),
                  flush=True)
    finally:
        cluster.stop()
        shutil.rmtree(WORK, ignore_errors=True)
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    print(f"\n{args.gib} GiB snapshot, stream of {stream_bytes / MIB:.0f} MiB, {args.rounds} rounds; medians "
          "(one node, one disk)")
    print(f"send     {median['send_mib_s']:7.0f} MiB/s  {median['send_cpu_s_per_gib']:.2f} CPU s/GiB  "
          f"send / NBD read ({median['read_mib_s']:.0f} MiB/s) = {median['send_mib_s'] / median['read_mib_s']:.2f}")
    print(f"receive  {median['receive_mib_s']:7.0f} MiB/s  {median['receive_cpu_s_per_gib']:.2f} CPU s/GiB  "
          f"receive / disk write ({median['disk_write_mib_s']:.0f} MiB/s) = "
          f"{median['receive_mib_s'] / median['disk_write_mib_s']:.2f}, / buffered write "
          f"({median['disk_buffered_write_mib_s']:.0f} MiB/s) = "
          f"{median['receive_mib_s'] / median['disk_buffered_write_mib_s']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"gib": args.gib, "rounds": rounds, "median": median}, indent=2))


if __name__ == "__main__":
    main()
