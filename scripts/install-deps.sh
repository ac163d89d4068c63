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
  restic         # S3 client: backups end to end
  s3cmd          # S3 client
  prometheus     # promtool: checks /metrics and deploy/monitoring's alert rules
  chromium       # headless: the dashboard test loads the page and reads its DOM
  procps
  gcc            # builds tests/failsync.c, the LD_PRELOAD that fails a node's sync
  libc6-dev
  unzip          # unpacks the Go toolchain that builds csi-sanity
  ca-certificates
  curl
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

# csi-sanity, the CSI conformance suite (Go), pinned; built once into /usr/local/lib/keel-tools.
# Debian 12's Go (1.19) is too old for csi-test v5.6 (go 1.25), so a pinned Go toolchain comes
# from the Go module proxy (go.dev is not always reachable; the proxy is), checked by SHA-256.
tools=/usr/local/lib/keel-tools
csi_sanity_version=v5.6.0
go_version=1.26.8
go_zip_sha256=30c2b1bf7dcc88d3eb0a1364e47ddd9128edb3110a30e8a0ef61cd5856b31de7
if [ ! -x "$tools/csi-sanity-$csi_sanity_version" ]; then
  mkdir -p "$tools"
  go_root="$tools/golang.org/toolchain@v0.0.1-go$go_version.linux-amd64"
  if [ ! -x "$go_root/bin/go" ]; then
    echo "install-deps: Go $go_version toolchain from proxy.golang.org"
    curl -fsSL -o "$tools/go.zip" \
      "https://proxy.golang.org/golang.org/toolchain/@v/v0.0.1-go$go_version.linux-amd64.zip"
    echo "$go_zip_sha256  $tools/go.zip" | sha256sum -c --quiet -
    unzip -q -o "$tools/go.zip" -d "$tools"
    rm -f "$tools/go.zip"
  fi
  echo "install-deps: csi-sanity $csi_sanity_version"
  GOTOOLCHAIN=local GOBIN="$tools/gobin" GOPATH="$tools/gopath" GOFLAGS=-modcacherw \
    "$go_root/bin/go" install "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@$csi_sanity_version"
  mv "$tools/gobin/csi-sanity" "$tools/csi-sanity-$csi_sanity_version"
  rm -rf "$tools/gopath"
fi
ln -sf "$tools/csi-sanity-$csi_sanity_version" /usr/local/bin/csi-sanity

command -v cargo >/dev/null || { echo "install-deps: cargo not found: install Rust 1.95 with rustup" >&2; exit 1; }
