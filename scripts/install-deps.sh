#!/usr/bin/env bash
# Installs what Keel's tests need on a Debian 12 machine (run as root). Idempotent and quick when
# everything is already there. The Rust toolchain (rustup, Rust 1.95) is expected on the machine.
set -euo pipefail

apt_packages=(
  fio            # fio with the nbd engine: volume verification and benchmarks
  qemu-utils     # qemu-img, qemu-io: NBD clients
  libnbd-bin     # nbdinfo, nbdcopy, nbdfuse: NBD clients, nbdfuse + loop for ext4/Postgres
  nbdkit         # `nbdkit file`: the zero-cost NBD reference in benchmarks
  fuse3          # fusermount3 for nbdfuse
  e2fsprogs      # mkfs.ext4 (full-disk test, Postgres on a volume)
  util-linux     # losetup, mount, runuser
  postgresql     # initdb, pg_ctl, pgbench, pg_amcheck on a Keel volume
  postgresql-contrib
  rclone         # S3 client
  procps
)
missing=()
for package in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
  echo "install-deps: apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# pytest, boto3 (Debian's 1.26 is too old), botocore[crt] (CRC32C checksums), awscli, requests.
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore \
  -r "$(dirname "$0")/../tests/s3/requirements.txt"

command -v cargo >/dev/null || { echo "install-deps: cargo not found: install Rust 1.95 with rustup" >&2; exit 1; }
