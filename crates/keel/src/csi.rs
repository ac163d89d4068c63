//! `keel csi`: the Kubernetes CSI driver (crate `keel-csi`), configured from flags and the
//! environment the way a DaemonSet or Deployment passes them.

use std::path::PathBuf;

use crate::cli::Connection;
use crate::config::DEFAULT_NBD_ADDR;

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum CsiMode {
    /// Identity and Controller: volumes, snapshots, clones, expansion (one per cluster).
    Controller,
    /// Identity and Node: attach, format, mount on this node (one per node).
    Node,
    /// All three services (tests, single-node clusters).
    Both,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum CsiAttach {
    /// The kernel NBD client where /dev/nbd0 and nbd-client exist, else nbdfuse + loop.
    Auto,
    /// `nbd-client` and /dev/nbdN (needs the kernel's nbd module).
    Kernel,
    /// nbdfuse exposes the volume as a file, attached to a loop device.
    Nbdfuse,
}

#[derive(clap::Args, Debug)]
pub struct CsiArgs {
    /// Where the CO connects: unix:///csi/csi.sock or tcp://HOST:PORT.
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    pub endpoint: String,
    /// Which CSI services to serve.
    #[arg(long, value_enum, default_value = "both")]
    pub mode: CsiMode,
    /// This node's id: the Keel node name of the server on this node (in Kubernetes, the node
    /// name, `spec.nodeName`). Default: the host name, as `keel server` defaults to.
    #[arg(long, env = "KEEL_CSI_NODE_ID")]
    pub node_id: Option<String>,
    /// NBD endpoint of the Keel server on this node.
    #[arg(long, env = "KEEL_NBD", default_value = DEFAULT_NBD_ADDR)]
    pub nbd: String,
    /// Where the node plugin records what it attached (kept across plugin restarts).
    #[arg(long, env = "KEEL_CSI_STATE_DIR", default_value = "/var/lib/keel-csi")]
    pub state_dir: PathBuf,
    /// How the node plugin attaches a volume as a block device.
    #[arg(long, value_enum, default_value = "auto")]
    pub attach: CsiAttach,
    #[command(flatten)]
    pub connection: Connection,
}

pub fn run(args: CsiArgs) -> anyhow::Result<()> {
    let token = args.connection.token()?;
    let node_id = match args.node_id {
        Some(id) => id,
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")?
            .trim()
            .to_string(),
    };
    let config = keel_csi::Config {
        endpoint: args.endpoint,
        mode: match args.mode {
            CsiMode::Controller => keel_csi::Mode::Controller,
            CsiMode::Node => keel_csi::Mode::Node,
            CsiMode::Both => keel_csi::Mode::Both,
        },
        admin: keel_csi::Admin::new(&args.connection.admin, token),
        node: keel_csi::NodeConfig {
            node_id,
            nbd: args.nbd,
            state_dir: args.state_dir,
            attach: match args.attach {
                CsiAttach::Auto => keel_csi::AttachMethod::Auto,
                CsiAttach::Kernel => keel_csi::AttachMethod::Kernel,
                CsiAttach::Nbdfuse => keel_csi::AttachMethod::Nbdfuse,
            },
        },
    };
    tokio::runtime::Runtime::new()?.block_on(keel_csi::serve(config))
}
