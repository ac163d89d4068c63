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
    pub store: StoreTuning,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreTuning {
    /// Segment file size. Default 256 MiB. Larger means fewer files; compaction works per segment.
    pub segment_size_max_bytes: u64,
    /// Payload bytes one group commit may carry. Default 16 MiB.
    pub batch_size_max_bytes: usize,
    /// Free space kept back per device; writes that add data fail with "no space" below it so
    /// deletes and compaction still work on a full disk. Default 64 MiB.
    pub reserve_bytes: u64,
    /// New log between durable index checkpoints. Bounds replay time after a crash. Default
    /// 64 MiB. Has no effect on the durability of acknowledged writes (the log carries them).
    pub checkpoint_interval_bytes: u64,
}

impl Default for StoreTuning {
    fn default() -> StoreTuning {
        let defaults = keel_store::StoreConfig::new(Vec::new());
        StoreTuning {
            segment_size_max_bytes: defaults.segment_size_max_bytes,
            batch_size_max_bytes: defaults.batch_size_max_bytes,
            reserve_bytes: defaults.reserve_bytes,
            checkpoint_interval_bytes: defaults.checkpoint_interval_bytes,
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
            store: StoreTuning::default(),
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
        Ok(())
    }

    pub fn store_config(&self) -> keel_store::StoreConfig {
        let mut config = keel_store::StoreConfig::new(self.data.clone());
        config.ephemeral = self.ephemeral;
        config.segment_size_max_bytes = self.store.segment_size_max_bytes;
        config.batch_size_max_bytes = self.store.batch_size_max_bytes;
        config.reserve_bytes = self.store.reserve_bytes;
        config.checkpoint_interval_bytes = self.store.checkpoint_interval_bytes;
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
}
