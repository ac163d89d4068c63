//! The server's one configuration struct, loaded from TOML (`keel server --config FILE`) and
//! overridden by command-line flags. Every field documents its default and what it means for
//! durability; `validate` runs once at load so the rest of the server trusts the values.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

pub const DEFAULT_DATA_DIR: &str = "./keel-data";
pub const DEFAULT_S3_ADDR: &str = "127.0.0.1:3900";
pub const DEFAULT_NBD_ADDR: &str = "127.0.0.1:10809";
pub const DEFAULT_ADMIN_ADDR: &str = "127.0.0.1:3903";
pub const DEFAULT_CLUSTER_ADDR: &str = "127.0.0.1:3902";
pub const DEFAULT_WITNESS_DATA_DIR: &str = "./keel-witness";
/// The join token's file in the first data directory (mode 0600).
pub const CLUSTER_TOKEN_FILE: &str = "cluster-token";

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Data directories. One, or two for a local mirror: every extent is written to both and a
    /// bad copy is repaired from the good one. Default `["./keel-data"]`.
    pub data: Vec<PathBuf>,
    /// Allow data directories on tmpfs/ramfs, where fsync is a no-op and a power cut loses
    /// everything. For tests and demos only. Default false.
    pub ephemeral: bool,
    /// S3 listen address. Default 127.0.0.1:3900 (loopback: put a TLS proxy in front to expose it).
    pub s3: SocketAddr,
    /// NBD listen address. Default 127.0.0.1:10809. NBD has no authentication: keep it on
    /// loopback or a private storage network.
    pub nbd: SocketAddr,
    /// Admin API, `/metrics` and dashboard. Default 127.0.0.1:3903. Mutations need the token in
    /// `<first data dir>/admin-token`.
    pub admin: SocketAddr,
    /// A file holding the admin token, for nodes that must share one (a Kubernetes Secret).
    /// Default: none (`<first data dir>/admin-token`, created on first start).
    pub admin_token_file: Option<PathBuf>,
    /// Health turns HEALTH_WARN (`KEEL_NEARFULL`) when a data directory's filesystem is more
    /// than this percent used. Default 95; 100 turns the check off.
    pub nearfull_percent: u8,
    /// Health turns HEALTH_WARN (`KEEL_SLOW_DEVICE`) when the p99 of the log's fdatasyncs over
    /// the last few minutes is above this many milliseconds. Default 200; 0 turns the check off.
    pub slow_sync_ms: f64,
    /// Register every NBD and S3 request for `keel ops` (in flight, the slowest of the last 10
    /// minutes, and the last 1000 slower than `slow_op_ms`). Default true.
    pub track_ops: bool,
    /// Requests slower than this many milliseconds are kept by `keel ops --slow` whatever
    /// else was slower. Default 1000.
    pub slow_op_ms: f64,
    pub store: StoreTuning,
    pub cluster: ClusterSettings,
    pub scrub: ScrubSettings,
}

/// Scrubs on a schedule (`keel store scrub` and `keel volume scrub` run at any time as well).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScrubSettings {
    /// Seconds between scheduled scrubs of this node's store (every copy on every device) and
    /// of the replicated volumes it is the primary of (replicas compared, differences
    /// repaired). Default 604800 (7 days); 0 turns them off. The schedule survives restarts.
    pub interval_seconds: u64,
    /// Percent of the time a scheduled scrub works (1–100); it sleeps the rest, leaving the
    /// disks to clients. Default 25.
    pub busy_percent: u8,
}

impl Default for ScrubSettings {
    fn default() -> ScrubSettings {
        ScrubSettings {
            interval_seconds: 7 * 24 * 3600,
            busy_percent: 25,
        }
    }
}

/// How this node takes part in a cluster. With the defaults, `keel server` is a one-node cluster
/// whose node-to-node port only listens on loopback.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterSettings {
    /// This node's name, unique in the cluster. Default: the host name.
    pub name: Option<String>,
    /// Node-to-node (Raft, replication) listen address. Default 127.0.0.1:3902. Every connection
    /// is authenticated with the cluster secret; traffic is checksummed but not encrypted, so
    /// keep it on a private network.
    pub listen: SocketAddr,
    /// The address other nodes dial to reach this one. Default: `listen` (set it when listening
    /// on 0.0.0.0).
    pub advertise: Option<String>,
    /// Node-to-node address of any member to join through, on first start. Default: none (the
    /// first start forms a new cluster). Ignored once the node is a member.
    pub join: Option<String>,
    /// The join token (cluster id and secret). Default: read from `<first data dir>/
    /// cluster-token`, which the first node writes when it forms the cluster; a joining node
    /// needs it given here, with `--join-token` or `KEEL_CLUSTER_TOKEN`, and stores it there.
    pub join_token: Option<String>,
    /// A metadata-only witness: only the Raft log, no volumes or objects, no S3 or NBD
    /// listeners. The third voter that lets two storage nodes lose one. Default false.
    pub witness: bool,
    /// Metadata voters the leader keeps when enough healthy nodes exist: 1, 3 or 5. Default 3.
    /// Three tolerate one voter failure, five two.
    pub voters: usize,
    /// Failure-domain labels (`host`, `rack`, `zone`, ...): replicas go to different domains.
    pub labels: std::collections::BTreeMap<String, String>,
    /// A node silent this long is `suspect`. Default 3000 ms.
    pub suspect_after_ms: u64,
    /// A node silent this long is `down`; a voter on it is replaced. Default 10000 ms.
    pub down_after_ms: u64,
    /// Raft entries between metadata snapshots (and log purges). Default 1000. A node that was
    /// away for longer catches up by snapshot.
    pub snapshot_every_entries: u64,
    /// A replicated volume's replica on a node that has been `down` this long is rebuilt on
    /// another storage node (replicas on removed nodes move at once; those on draining nodes
    /// are copied off first). Default
    /// 300000 ms (5 minutes): long enough for a reboot, which resyncs only what changed.
    pub replica_move_after_ms: u64,
    /// Caps what catching a replica up ships, per replica, in MiB/s (resync after an
    /// absence, a replica added or moved), so a rebuild leaves the disk and network to the
    /// clients. Default 0: unlimited.
    pub resync_mib_per_second: u64,
    /// While clients are active on either node of a resync (any volume or bucket), it works
    /// only this share of the time (1 to 100 %; it sleeps between 1 MiB chunks), so a rebuild
    /// does not take their latency with it; when they are idle it goes at full speed. Default
    /// 25; 100: never yields.
    pub resync_busy_percent: u8,
    /// Most whole-volume catch-ups (a replica added, rebuilt elsewhere or copied off a
    /// draining node) this node sends at once, as the primary of their volumes, and,
    /// separately, most it receives at once; the others wait their turn (`keel volume info`
    /// shows them waiting), so a drain or a lost node does not start a copy of every volume
    /// at once. A catch-up after a short absence never waits. Default 2; at least 1.
    pub rebuilds_max: usize,
    /// Whether a primary copies a snapshot's data to the in-sync replicas whose copy of it is
    /// incomplete (out of sync when it was taken, placed after it, or not the node that
    /// received its stream), paced as a resync. Default true; false leaves such copies
    /// incomplete, served by the nodes that hold them whole.
    pub snapshot_repair: bool,
    /// Enables `POST /api/v1/debug/faults` (dropping traffic to chosen nodes, for partition
    /// tests). Never on in production. Default false.
    pub debug_faults: bool,
}

impl Default for ClusterSettings {
    fn default() -> ClusterSettings {
        let timing = keel_cluster::Timing::default();
        ClusterSettings {
            name: None,
            listen: parse_default(DEFAULT_CLUSTER_ADDR),
            advertise: None,
            join: None,
            join_token: None,
            witness: false,
            voters: 3,
            labels: Default::default(),
            suspect_after_ms: timing.suspect_after.as_millis() as u64,
            down_after_ms: timing.down_after.as_millis() as u64,
            snapshot_every_entries: timing.snapshot_every_entries,
            replica_move_after_ms: 300_000,
            resync_mib_per_second: 0,
            resync_busy_percent: 25,
            rebuilds_max: 2,
            snapshot_repair: true,
            debug_faults: false,
        }
    }
}

impl ClusterSettings {
    /// The name this node uses: the configured one, or the host name.
    pub fn node_name(&self) -> String {
        if let Some(name) = &self.name {
            return name.clone();
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|name| name.trim().to_string())
            .unwrap_or_default();
        let cleaned: String = host
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                    c
                } else {
                    '-'
                }
            })
            .take(keel_catalog::NAME_MAX_BYTES)
            .collect();
        if cleaned.is_empty() || cleaned.starts_with('.') {
            "keel".to_string()
        } else {
            cleaned
        }
    }

    pub fn timing(&self) -> keel_cluster::Timing {
        keel_cluster::Timing {
            suspect_after: std::time::Duration::from_millis(self.suspect_after_ms),
            down_after: std::time::Duration::from_millis(self.down_after_ms),
            snapshot_every_entries: self.snapshot_every_entries.max(2),
            ..keel_cluster::Timing::default()
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreTuning {
    /// Segment file size. Default 128 MiB. Larger means fewer files; compaction works per segment.
    pub segment_size_max_bytes: u64,
    /// Payload bytes one group commit may carry. Default 16 MiB.
    pub batch_size_max_bytes: usize,
    /// Free space kept back per device; writes that add data fail with "no space" below it so
    /// deletes and compaction still work on a full disk. Default 256 MiB (never less than 16 MiB,
    /// kept for the index).
    pub reserve_bytes: u64,
    /// New log between durable index checkpoints. Bounds replay time after a crash. Default
    /// 64 MiB. Has no effect on the durability of acknowledged writes (the log carries them).
    pub checkpoint_interval_bytes: u64,
    /// A group commit carrying at least this many bytes that this node does not read back
    /// soon (a replica's copy of a volume, a received snapshot stream, compaction's copies)
    /// goes to the disk around the page cache (`O_DIRECT`). Default 256 KiB; 0 writes
    /// everything through the cache.
    pub direct_write_min_bytes: usize,
}

impl Default for StoreTuning {
    fn default() -> StoreTuning {
        let defaults = keel_store::StoreConfig::new(Vec::new());
        StoreTuning {
            segment_size_max_bytes: defaults.segment_size_max_bytes,
            batch_size_max_bytes: defaults.batch_size_max_bytes,
            reserve_bytes: defaults.reserve_bytes,
            checkpoint_interval_bytes: defaults.checkpoint_interval_bytes,
            direct_write_min_bytes: defaults.direct_write_min_bytes,
        }
    }
}

impl Default for Config {
    fn default() -> Config {
        Config {
            data: vec![PathBuf::from(DEFAULT_DATA_DIR)],
            ephemeral: false,
            s3: parse_default(DEFAULT_S3_ADDR),
            nbd: parse_default(DEFAULT_NBD_ADDR),
            admin: parse_default(DEFAULT_ADMIN_ADDR),
            admin_token_file: None,
            nearfull_percent: 95,
            slow_sync_ms: 200.0,
            track_ops: true,
            slow_op_ms: 1000.0,
            store: StoreTuning::default(),
            cluster: ClusterSettings::default(),
            scrub: ScrubSettings::default(),
        }
    }
}

fn parse_default(addr: &str) -> SocketAddr {
    addr.parse()
        .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
}

impl Config {
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if self.data.is_empty() || self.data.len() > 2 {
            bail!(
                "give one data directory, or two for a local mirror (got {})",
                self.data.len()
            );
        }
        if self.data.len() == 2 && self.data[0] == self.data[1] {
            bail!("the two mirror directories must differ");
        }
        if self.store.segment_size_max_bytes < (1 << 20) {
            bail!("store.segment_size_max_bytes must be at least 1 MiB");
        }
        if self.store.batch_size_max_bytes < (1 << 20) {
            bail!("store.batch_size_max_bytes must be at least 1 MiB");
        }
        if self.nearfull_percent == 0 || self.nearfull_percent > 100 {
            bail!(
                "nearfull_percent must be 1 to 100 (got {})",
                self.nearfull_percent
            );
        }
        if !self.slow_sync_ms.is_finite() || self.slow_sync_ms < 0.0 {
            bail!(
                "slow_sync_ms must be 0 (off) or a positive number of milliseconds (got {})",
                self.slow_sync_ms
            );
        }
        if !self.slow_op_ms.is_finite() || self.slow_op_ms <= 0.0 {
            bail!(
                "slow_op_ms must be a positive number of milliseconds (got {})",
                self.slow_op_ms
            );
        }
        if self.scrub.busy_percent == 0 || self.scrub.busy_percent > 100 {
            bail!(
                "scrub.busy_percent must be 1 to 100 (got {})",
                self.scrub.busy_percent
            );
        }
        if self.cluster.resync_busy_percent == 0 || self.cluster.resync_busy_percent > 100 {
            bail!(
                "cluster.resync_busy_percent must be 1 to 100 (got {})",
                self.cluster.resync_busy_percent
            );
        }
        if self.cluster.rebuilds_max == 0 {
            bail!("cluster.rebuilds_max must be at least 1 (got 0)");
        }
        if ![1, 3, 5].contains(&self.cluster.voters) {
            bail!(
                "cluster.voters must be 1, 3 or 5 (got {})",
                self.cluster.voters
            );
        }
        if self.cluster.suspect_after_ms == 0
            || self.cluster.down_after_ms <= self.cluster.suspect_after_ms
        {
            bail!("cluster.down_after_ms must be above cluster.suspect_after_ms, both above 0");
        }
        keel_catalog::validate_name("node", &self.cluster.node_name())
            .map_err(|error| anyhow::anyhow!("cluster.name: {error}"))?;
        if self.cluster.listen.ip().is_unspecified() && self.cluster.advertise.is_none() {
            bail!(
                "cluster.listen is {}: give cluster.advertise (--advertise HOST:PORT), the \
                 address other nodes dial",
                self.cluster.listen
            );
        }
        Ok(())
    }

    /// Where the join token lives.
    pub fn token_path(&self) -> PathBuf {
        self.data[0].join(CLUSTER_TOKEN_FILE)
    }

    /// The address other nodes dial for this node's cluster traffic.
    pub fn cluster_advertise(&self) -> String {
        self.cluster
            .advertise
            .clone()
            .unwrap_or_else(|| self.cluster.listen.to_string())
    }

    pub fn store_config(&self) -> keel_store::StoreConfig {
        let mut config = keel_store::StoreConfig::new(self.data.clone());
        config.ephemeral = self.ephemeral;
        config.segment_size_max_bytes = self.store.segment_size_max_bytes;
        config.batch_size_max_bytes = self.store.batch_size_max_bytes;
        config.reserve_bytes = self.store.reserve_bytes;
        config.checkpoint_interval_bytes = self.store.checkpoint_interval_bytes;
        config.direct_write_min_bytes = self.store.direct_write_min_bytes;
        config
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A config file overrides only what it names; unknown fields are refused.
    #[test]
    fn toml_overrides_and_refuses_unknown_fields() {
        let config: Config = toml::from_str(
            "data = [\"/srv/a\", \"/srv/b\"]\ns3 = \"127.0.0.1:9000\"\n[store]\nreserve_bytes = 1024\n",
        )
        .unwrap();
        assert_eq!(config.data.len(), 2);
        assert_eq!(config.s3.port(), 9000);
        assert_eq!(config.nbd.port(), 10809);
        assert_eq!(config.store.reserve_bytes, 1024);
        config.validate().unwrap();
        assert!(toml::from_str::<Config>("colour = \"blue\"").is_err());
    }

    /// `slow_sync_ms` takes whole and fractional milliseconds; a negative one is refused.
    #[test]
    fn slow_sync_ms_takes_integers_and_fractions() {
        for (text, value) in [("slow_sync_ms = 200", 200.0), ("slow_sync_ms = 0.5", 0.5)] {
            let config: Config = toml::from_str(text).unwrap();
            assert_eq!(config.slow_sync_ms, value);
            config.validate().unwrap();
        }
        let negative: Config = toml::from_str("slow_sync_ms = -1").unwrap();
        assert!(negative.validate().is_err());
    }

    /// `cluster.rebuilds_max` defaults to 2 and must be at least 1.
    #[test]
    fn rebuilds_max_is_at_least_one() {
        assert_eq!(Config::default().cluster.rebuilds_max, 2);
        let one: Config = toml::from_str("[cluster]\nrebuilds_max = 1\n").unwrap();
        one.validate().unwrap();
        let none: Config = toml::from_str("[cluster]\nrebuilds_max = 0\n").unwrap();
        let refused = none.validate().unwrap_err().to_string();
        assert!(refused.contains("cluster.rebuilds_max"), "{refused}");
    }
}
