//! Keel's Kubernetes CSI driver, in the `keel` binary (`keel csi`): the Identity, Controller
//! and Node services of the CSI spec (v1.13, the version csi-sanity v5.6 tests), over a Keel
//! server's admin API and NBD endpoint.
//!
//! - The controller creates, deletes, snapshots, clones and grows Keel volumes.
//! - The node attaches a volume as a block device (the kernel NBD client where `/dev/nbd*`
//!   exists, nbdfuse + a loop device elsewhere), formats it when it is empty, mounts it at the
//!   staging path and bind-mounts it into pods.

mod admin;
mod controller;
mod node;

use std::path::PathBuf;

use tonic::{Request, Response, Status};

pub use admin::Admin;
pub use node::{AttachMethod, NodeConfig};

pub mod proto {
    tonic::include_proto!("csi.v1");
}

use proto::identity_server::{Identity, IdentityServer};
use proto::volume_capability::access_mode::Mode as AccessMode;
use proto::volume_capability::AccessType;
use proto::*;

/// The driver's name, as StorageClasses name it (`provisioner: csi.keel.io`).
pub const DRIVER_NAME: &str = "csi.keel.io";
/// Keel volumes are multiples of this.
pub const BLOCK_BYTES: u64 = 4096;
/// Filesystems the node formats and mounts (an empty `fsType` means ext4).
pub const FS_TYPES: &[&str] = &["ext4", "xfs"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Controller,
    Node,
    Both,
}

pub struct Config {
    /// `unix:///path/csi.sock` or `tcp://127.0.0.1:PORT`.
    pub endpoint: String,
    pub mode: Mode,
    pub admin: Admin,
    pub node: NodeConfig,
}

pub fn round_up_to_block(bytes: u64) -> u64 {
    bytes.div_ceil(BLOCK_BYTES).saturating_mul(BLOCK_BYTES)
}

/// Whether the driver serves every capability asked for: single-node access modes only (a
/// Keel volume is written through one primary), block or a filesystem it knows.
pub fn check_capabilities(capabilities: &[VolumeCapability]) -> Result<(), String> {
    for capability in capabilities {
        let mode = capability
            .access_mode
            .as_ref()
            .map(|m| m.mode)
            .and_then(|m| AccessMode::try_from(m).ok())
            .ok_or("a volume capability has no access mode")?;
        match mode {
            AccessMode::SingleNodeWriter
            | AccessMode::SingleNodeReaderOnly
            | AccessMode::SingleNodeSingleWriter
            | AccessMode::SingleNodeMultiWriter => {}
            other => {
                return Err(format!(
                "access mode {} is not supported: a Keel volume is attached on one node at a time",
                other.as_str_name()
            ))
            }
        }
        match &capability.access_type {
            Some(AccessType::Block(_)) => {}
            Some(AccessType::Mount(mount)) => {
                if !mount.fs_type.is_empty() && !FS_TYPES.contains(&mount.fs_type.as_str()) {
                    return Err(format!(
                        "fsType {:?} is not supported: use one of {FS_TYPES:?}",
                        mount.fs_type
                    ));
                }
            }
            None => return Err("a volume capability has neither block nor mount".to_string()),
        }
    }
    Ok(())
}

struct IdentityService {
    mode: Mode,
    admin: Admin,
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _request: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: DRIVER_NAME.to_string(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _request: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        use plugin_capability::{service, volume_expansion, Service, Type, VolumeExpansion};
        let mut capabilities = Vec::new();
        if self.mode != Mode::Node {
            capabilities.push(PluginCapability {
                r#type: Some(Type::Service(Service {
                    r#type: service::Type::ControllerService as i32,
                })),
            });
        }
        // Volumes are attached on a node holding a replica (NodeGetInfo and CreateVolume
        // speak of nodes by `topology.csi.keel.io/node`).
        capabilities.push(PluginCapability {
            r#type: Some(Type::Service(Service {
                r#type: service::Type::VolumeAccessibilityConstraints as i32,
            })),
        });
        // A volume attached through nbdfuse keeps the size it had when it was staged: it grows
        // when the CO stages it again, so expansion is offline.
        capabilities.push(PluginCapability {
            r#type: Some(Type::VolumeExpansion(VolumeExpansion {
                r#type: volume_expansion::Type::Offline as i32,
            })),
        });
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn probe(
        &self,
        _request: Request<ProbeRequest>,
    ) -> Result<Response<ProbeResponse>, Status> {
        let ready = self.admin.status().await.is_ok();
        Ok(Response::new(ProbeResponse { ready: Some(ready) }))
    }
}

/// Serves the configured services on the endpoint until the process is stopped.
pub async fn serve(config: Config) -> anyhow::Result<()> {
    use proto::controller_server::ControllerServer;
    use proto::node_server::NodeServer;

    let identity = IdentityServer::new(IdentityService {
        mode: config.mode,
        admin: config.admin.clone(),
    });
    let controller = (config.mode != Mode::Node)
        .then(|| ControllerServer::new(controller::ControllerService::new(config.admin.clone())));
    let node = match config.mode {
        Mode::Controller => None,
        Mode::Node | Mode::Both => Some(NodeServer::new(node::NodeService::new(
            config.node,
            config.admin.clone(),
        )?)),
    };
    let router = tonic::transport::Server::builder()
        .add_service(identity)
        .add_optional_service(controller)
        .add_optional_service(node);
    if let Some(path) = config.endpoint.strip_prefix("unix://") {
        let path = PathBuf::from(path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        // A socket left by a previous run of the plugin.
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(error.into()),
        }
        let listener = tokio::net::UnixListener::bind(&path)?;
        tracing::info!(endpoint = %config.endpoint, mode = ?config.mode, "CSI driver serving");
        router
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
            .await?;
    } else if let Some(address) = config.endpoint.strip_prefix("tcp://") {
        let listener = tokio::net::TcpListener::bind(address).await?;
        tracing::info!(endpoint = %config.endpoint, mode = ?config.mode, "CSI driver serving");
        router
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await?;
    } else {
        anyhow::bail!(
            "endpoint {:?}: use unix:///path/csi.sock or tcp://HOST:PORT",
            config.endpoint
        );
    }
    Ok(())
}
