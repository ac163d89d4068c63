//! The CSI Controller service: volumes, snapshots, clones and expansion, as calls to the Keel
//! admin API. A CSI volume id is the Keel volume's name; a CSI snapshot id is the Keel
//! snapshot's GUID (unique across volumes, and short enough for CSI's 128-byte ids).

use std::collections::HashMap;

use serde_json::json;
use tonic::{Request, Response, Status};

use crate::admin::{Admin, NodeJson, SnapshotJson, VolumeJson};
use crate::node::TOPOLOGY_NODE_KEY;
use crate::proto::controller_server::Controller;
use crate::proto::controller_service_capability::{rpc, Rpc};
use crate::proto::volume_content_source::{SnapshotSource, Type as Source, VolumeSource};
use crate::proto::*;
use crate::{check_capabilities, round_up_to_block, BLOCK_BYTES};

/// Size of a volume created without a capacity range.
pub const DEFAULT_VOLUME_BYTES: u64 = 1 << 30;
/// Snapshots the driver takes on a source volume to clone it (CSI's volume content source);
/// hidden from ListSnapshots and deleted with the clone.
const CLONE_SOURCE_PREFIX: &str = "keel-csi-clone-source-";
/// `StorageClass` parameters the driver understands, and the Keel volume fields they set.
const PARAMETERS: &[&str] = &[
    "compression",
    "iopsMax",
    "bandwidthMaxMiBPerSecond",
    "replicas",
];
/// Parameters the Kubernetes sidecars add (`csi.storage.k8s.io/...`): not Keel's to check.
const SIDECAR_PARAMETER_PREFIX: &str = "csi.storage.k8s.io/";

pub struct ControllerService {
    admin: Admin,
}

impl ControllerService {
    pub fn new(admin: Admin) -> ControllerService {
        ControllerService { admin }
    }

    /// The admin API of a node, where it listens on an address others can reach.
    fn node_admin(&self, node: &NodeJson) -> Admin {
        match node.admin.as_deref() {
            Some(address) if !unspecified(address) => self.admin.at(address),
            _ => self.admin.clone(),
        }
    }

    /// The admin API of a volume's primary: a volume's snapshots, clones and resizes are
    /// served where the volume is (another node answers 421).
    fn primary_admin(&self, volume: &VolumeJson, nodes: &[NodeJson]) -> Admin {
        volume
            .primary
            .and_then(|primary| nodes.iter().find(|node| node.id == primary))
            .map_or_else(|| self.admin.clone(), |node| self.node_admin(node))
    }

    async fn admin_for(&self, volume: &str) -> Result<Admin, Status> {
        let Some(volume) = self.admin.volume(volume).await? else {
            return Ok(self.admin.clone());
        };
        Ok(self.primary_admin(&volume, &self.admin.nodes().await?))
    }

    /// The admin API of the node the CO wants a new volume on (its first replica, where the
    /// pod's node plugin attaches it), from the topology it asked for.
    async fn admin_for_topology(
        &self,
        requirement: Option<&TopologyRequirement>,
    ) -> Result<Admin, Status> {
        let wanted = wanted_nodes(requirement);
        if wanted.is_empty() {
            return Ok(self.admin.clone());
        }
        let nodes = self.admin.nodes().await?;
        wanted
            .iter()
            .find_map(|name| nodes.iter().find(|node| node.name == *name))
            .map(|node| self.node_admin(node))
            .ok_or_else(|| {
                Status::resource_exhausted(format!(
                    "no Keel storage node among the nodes the volume may live on: {wanted:?}"
                ))
            })
    }

    async fn topology_of(&self, volume: &VolumeJson) -> Result<Vec<Topology>, Status> {
        Ok(topology(volume, &self.admin.nodes().await?))
    }

    /// Every snapshot of every volume, with the volume it belongs to, hidden ones excluded.
    async fn all_snapshots(&self) -> Result<Vec<(String, SnapshotJson)>, Status> {
        let mut all = Vec::new();
        let nodes = self.admin.nodes().await?;
        for volume in self.admin.volumes().await? {
            let admin = self.primary_admin(&volume, &nodes);
            let snapshots = match admin.snapshots(&volume.name).await {
                Ok(snapshots) => snapshots,
                // Deleted between the two calls.
                Err(failure) if failure.not_found() => continue,
                Err(failure) => return Err(failure.into()),
            };
            for snapshot in snapshots {
                if !snapshot.name.starts_with(CLONE_SOURCE_PREFIX) {
                    all.push((volume.name.clone(), snapshot));
                }
            }
        }
        all.sort_by(|a, b| a.1.guid.cmp(&b.1.guid));
        Ok(all)
    }

    async fn snapshot_by_id(&self, id: &str) -> Result<Option<(String, SnapshotJson)>, Status> {
        Ok(self
            .all_snapshots()
            .await?
            .into_iter()
            .find(|(_, snapshot)| snapshot.guid == id))
    }

    /// Creates `name` from a content source: a clone of a snapshot, or of a snapshot the
    /// driver takes of a source volume.
    async fn create_from_source(
        &self,
        name: &str,
        source: &Source,
        requirement: Option<&TopologyRequirement>,
    ) -> Result<VolumeJson, Status> {
        let (volume, snapshot) = match source {
            Source::Snapshot(SnapshotSource { snapshot_id }) => {
                let (volume, snapshot) =
                    self.snapshot_by_id(snapshot_id).await?.ok_or_else(|| {
                        Status::not_found(format!("source snapshot {snapshot_id:?} not found"))
                    })?;
                (volume, snapshot.name)
            }
            Source::Volume(VolumeSource { volume_id }) => {
                if self.admin.volume(volume_id).await?.is_none() {
                    return Err(Status::not_found(format!(
                        "source volume {volume_id:?} not found"
                    )));
                }
                let snapshot = clone_source_snapshot(name);
                let admin = self.admin_for(volume_id).await?;
                let existing = admin.snapshots(volume_id).await?;
                if !existing.iter().any(|s| s.name == snapshot) {
                    admin.create_snapshot(volume_id, &snapshot).await?;
                }
                (volume_id.clone(), snapshot)
            }
        };
        // A clone reads through its parent's blocks: it lives where the parent does. When the
        // CO wants it elsewhere, say so (ResourceExhausted lets the scheduler pick another node)
        // rather than create a volume its pod cannot attach.
        let parent = (self.admin.volume(&volume).await?)
            .ok_or_else(|| Status::not_found(format!("source volume {volume:?} not found")))?;
        let nodes = self.admin.nodes().await?;
        let wanted = wanted_nodes(requirement);
        let homes: Vec<&str> = (parent.replicas.iter())
            .filter_map(|id| nodes.iter().find(|node| node.id == *id))
            .map(|node| node.name.as_str())
            .collect();
        if !wanted.is_empty() && !homes.iter().any(|home| wanted.contains(home)) {
            return Err(Status::resource_exhausted(format!(
                "a clone of {volume:?} lives on its nodes {homes:?}, none of which the volume may use ({wanted:?})"
            )));
        }
        let admin = self.primary_admin(&parent, &nodes);
        Ok(admin.clone_snapshot(&volume, &snapshot, name).await?)
    }
}

/// The hidden snapshot a volume clone named `clone` is made from (deterministic, so a retried
/// CreateVolume reuses it; FNV-1a keeps it short whatever the clone's name).
fn clone_source_snapshot(clone: &str) -> String {
    let hash = clone.bytes().fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{CLONE_SOURCE_PREFIX}{hash:016x}")
}

/// The size to create for a capacity range: the smallest block multiple at or above the
/// required bytes, within the limit.
fn size_for(range: Option<&CapacityRange>) -> Result<u64, Status> {
    let (required, limit) = match range {
        Some(range) => (range.required_bytes, range.limit_bytes),
        None => (0, 0),
    };
    if required < 0 || limit < 0 {
        return Err(Status::invalid_argument(
            "capacity bytes must not be negative",
        ));
    }
    let (required, limit) = (required as u64, limit as u64);
    let size = if required == 0 {
        if limit == 0 {
            DEFAULT_VOLUME_BYTES
        } else {
            DEFAULT_VOLUME_BYTES.min(limit / BLOCK_BYTES * BLOCK_BYTES)
        }
    } else {
        round_up_to_block(required)
    };
    if size == 0 || (limit != 0 && size > limit) {
        return Err(Status::out_of_range(format!(
            "no size that is a multiple of {BLOCK_BYTES} bytes fits between {required} and {limit} bytes"
        )));
    }
    Ok(size)
}

fn fits(size: u64, range: Option<&CapacityRange>) -> bool {
    range.is_none_or(|range| {
        size >= range.required_bytes.max(0) as u64
            && (range.limit_bytes <= 0 || size <= range.limit_bytes as u64)
    })
}

/// The Keel volume fields a StorageClass's parameters set; unknown parameters are refused
/// so a typo does not silently create a volume without the limit it asked for.
fn volume_request(
    name: &str,
    size_bytes: u64,
    parameters: &HashMap<String, String>,
) -> Result<serde_json::Value, Status> {
    let mut request = json!({ "name": name, "size_bytes": size_bytes });
    for (key, value) in parameters {
        if key.starts_with(SIDECAR_PARAMETER_PREFIX) {
            continue;
        }
        let number = || {
            value.parse::<u64>().map_err(|_| {
                Status::invalid_argument(format!("parameter {key}={value:?} is not a number"))
            })
        };
        match key.as_str() {
            "compression" => request["compression"] = json!(value),
            "iopsMax" => request["iops_max"] = json!(number()?),
            "bandwidthMaxMiBPerSecond" => {
                request["bandwidth_max_mib_per_second"] = json!(number()?)
            }
            "replicas" => request["replicas"] = json!(number()?),
            _ => {
                return Err(Status::invalid_argument(format!(
                    "unknown parameter {key:?}: Keel understands {}",
                    PARAMETERS.join(", ")
                )))
            }
        }
    }
    Ok(request)
}

fn csi_volume(
    volume: &VolumeJson,
    source: Option<VolumeContentSource>,
    topology: Vec<Topology>,
) -> Volume {
    Volume {
        capacity_bytes: volume.size_bytes as i64,
        volume_id: volume.name.clone(),
        content_source: source,
        accessible_topology: topology,
        ..Default::default()
    }
}

/// The node names a topology requirement allows, preferred first; empty for "anywhere".
fn wanted_nodes(requirement: Option<&TopologyRequirement>) -> Vec<&str> {
    requirement
        .map(|r| {
            (r.preferred.iter())
                .chain(&r.requisite)
                .filter_map(|topology| topology.segments.get(TOPOLOGY_NODE_KEY))
                .map(String::as_str)
                .collect()
        })
        .unwrap_or_default()
}

/// Where a volume can be attached: the nodes holding its replicas.
fn topology(volume: &VolumeJson, nodes: &[NodeJson]) -> Vec<Topology> {
    volume
        .replicas
        .iter()
        .filter_map(|id| nodes.iter().find(|node| node.id == *id))
        .map(|node| Topology {
            segments: [(TOPOLOGY_NODE_KEY.to_string(), node.name.clone())].into(),
        })
        .collect()
}

/// A listen address no other node can dial: 0.0.0.0:3903, [::]:3903, or port 0 (a node that
/// just started on an ephemeral port records the bound one within a report interval).
fn unspecified(address: &str) -> bool {
    address
        .parse::<std::net::SocketAddr>()
        .is_ok_and(|address| address.ip().is_unspecified() || address.port() == 0)
}

fn csi_snapshot(volume: &str, snapshot: &SnapshotJson) -> Snapshot {
    Snapshot {
        size_bytes: snapshot.size_bytes as i64,
        snapshot_id: snapshot.guid.clone(),
        source_volume_id: volume.to_string(),
        creation_time: Some(prost_types::Timestamp {
            seconds: snapshot.created_unix_seconds as i64,
            nanos: 0,
        }),
        ready_to_use: true,
        ..Default::default()
    }
}

/// Pagination tokens: `after:<key>`, the key of the last entry returned. Anything else is a
/// token this driver never handed out.
fn parse_token(token: &str) -> Result<Option<&str>, Status> {
    if token.is_empty() {
        return Ok(None);
    }
    token
        .strip_prefix("after:")
        .map(Some)
        .ok_or_else(|| Status::aborted(format!("starting_token {token:?} is not one of ours")))
}

fn page<T>(
    entries: Vec<T>,
    key: impl Fn(&T) -> &str,
    token: &str,
    max_entries: i32,
) -> Result<(Vec<T>, String), Status> {
    if max_entries < 0 {
        return Err(Status::invalid_argument("max_entries must not be negative"));
    }
    let after = parse_token(token)?;
    let mut rest: Vec<T> = entries
        .into_iter()
        .filter(|entry| after.is_none_or(|after| key(entry) > after))
        .collect();
    let mut next = String::new();
    if max_entries > 0 && rest.len() > max_entries as usize {
        rest.truncate(max_entries as usize);
        if let Some(last) = rest.last() {
            next = format!("after:{}", key(last));
        }
    }
    Ok((rest, next))
}

fn capability(kind: rpc::Type) -> ControllerServiceCapability {
    ControllerServiceCapability {
        r#type: Some(controller_service_capability::Type::Rpc(Rpc {
            r#type: kind as i32,
        })),
    }
}

fn require(value: &str, what: &str) -> Result<(), Status> {
    if value.is_empty() {
        return Err(Status::invalid_argument(format!("{what} is required")));
    }
    Ok(())
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        request: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let request = request.into_inner();
        require(&request.name, "name")?;
        if request.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities are required"));
        }
        check_capabilities(&request.volume_capabilities).map_err(Status::invalid_argument)?;
        let range = request.capacity_range.as_ref();
        let size = size_for(range)?;
        let source = request
            .volume_content_source
            .as_ref()
            .and_then(|source| source.r#type.clone());
        // Idempotent by name: an existing volume that fits answers as if just created.
        if let Some(existing) = self.admin.volume(&request.name).await? {
            if !fits(existing.size_bytes, range) {
                return Err(Status::already_exists(format!(
                    "volume {:?} exists with {} bytes, outside the requested range",
                    existing.name, existing.size_bytes
                )));
            }
            let topology = self.topology_of(&existing).await?;
            return Ok(Response::new(CreateVolumeResponse {
                volume: Some(csi_volume(
                    &existing,
                    request.volume_content_source,
                    topology,
                )),
            }));
        }
        let mut volume = match &source {
            None => {
                let body = volume_request(&request.name, size, &request.parameters)?;
                let admin =
                    (self.admin_for_topology(request.accessibility_requirements.as_ref())).await?;
                admin.create_volume(body).await?
            }
            Some(source) => {
                // A clone has its parent's settings; parameters are checked all the same.
                volume_request(&request.name, size, &request.parameters)?;
                let requirement = request.accessibility_requirements.as_ref();
                self.create_from_source(&request.name, source, requirement)
                    .await?
            }
        };
        if volume.size_bytes < size {
            let admin = self.admin_for(&volume.name).await?;
            admin.resize_volume(&volume.name, size).await?;
            volume.size_bytes = size;
        }
        // Where it landed (a clone lives with its parent), as the list reports it now.
        let listed = self.admin.volume(&volume.name).await?;
        let topology = match &listed {
            Some(listed) => self.topology_of(listed).await?,
            None => Vec::new(),
        };
        Ok(Response::new(CreateVolumeResponse {
            volume: Some(csi_volume(&volume, request.volume_content_source, topology)),
        }))
    }

    async fn delete_volume(
        &self,
        request: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let name = request.into_inner().volume_id;
        require(&name, "volume_id")?;
        let Some(volume) = self.admin.volume(&name).await? else {
            return Ok(Response::new(DeleteVolumeResponse {}));
        };
        let snapshots = self.admin_for(&name).await?.snapshots(&name).await?;
        if let Some(snapshot) = snapshots
            .iter()
            .find(|s| !s.name.starts_with(CLONE_SOURCE_PREFIX))
        {
            return Err(Status::failed_precondition(format!(
                "volume {name:?} has snapshot {:?} (id {}); Keel keeps a volume's snapshots inside it, delete them first",
                snapshot.name, snapshot.guid
            )));
        }
        let clones: Vec<String> = (self.admin.volumes().await?)
            .into_iter()
            .filter(|v| {
                v.origin
                    .as_deref()
                    .is_some_and(|origin| origin.starts_with(&format!("{name}@")))
            })
            .map(|v| v.name)
            .collect();
        if !clones.is_empty() {
            return Err(Status::failed_precondition(format!(
                "volumes {clones:?} were cloned from {name:?} and read through it; delete them first"
            )));
        }
        match self.admin.delete_volume(&name).await {
            Ok(()) => {}
            Err(failure) if failure.not_found() => {}
            Err(failure) => return Err(failure.into()),
        }
        // A volume cloned from a volume: drop the snapshot the driver took of its source.
        if let Some((parent, snapshot)) = volume.origin.as_deref().and_then(|o| o.split_once('@')) {
            if snapshot == clone_source_snapshot(&name) {
                match self.admin.delete_snapshot(parent, snapshot).await {
                    Ok(()) => {}
                    Err(failure) if failure.not_found() => {}
                    Err(failure) => return Err(failure.into()),
                }
            }
        }
        Ok(Response::new(DeleteVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let request = request.into_inner();
        require(&request.volume_id, "volume_id")?;
        if request.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities are required"));
        }
        if self.admin.volume(&request.volume_id).await?.is_none() {
            return Err(Status::not_found(format!(
                "volume {:?} not found",
                request.volume_id
            )));
        }
        let answer = match check_capabilities(&request.volume_capabilities) {
            Ok(()) => ValidateVolumeCapabilitiesResponse {
                confirmed: Some(validate_volume_capabilities_response::Confirmed {
                    volume_context: request.volume_context,
                    volume_capabilities: request.volume_capabilities,
                    parameters: request.parameters,
                    mutable_parameters: request.mutable_parameters,
                }),
                message: String::new(),
            },
            Err(message) => ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message,
            },
        };
        Ok(Response::new(answer))
    }

    async fn list_volumes(
        &self,
        request: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        let request = request.into_inner();
        let mut volumes = self.admin.volumes().await?;
        volumes.sort_by(|a, b| a.name.cmp(&b.name));
        let (volumes, next_token) = page(
            volumes,
            |v| v.name.as_str(),
            &request.starting_token,
            request.max_entries,
        )?;
        let nodes = self.admin.nodes().await?;
        let entries = volumes
            .iter()
            .map(|volume| list_volumes_response::Entry {
                volume: Some(csi_volume(volume, None, topology(volume, &nodes))),
                status: None,
            })
            .collect();
        Ok(Response::new(ListVolumesResponse {
            entries,
            next_token,
        }))
    }

    async fn get_capacity(
        &self,
        _request: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        let status = self.admin.status().await?;
        let available = status["store"]["available_bytes"].as_u64().unwrap_or(0);
        Ok(Response::new(GetCapacityResponse {
            available_capacity: available as i64,
            maximum_volume_size: None,
            minimum_volume_size: Some(BLOCK_BYTES as i64),
        }))
    }

    async fn controller_get_capabilities(
        &self,
        _request: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        let capabilities = [
            rpc::Type::CreateDeleteVolume,
            rpc::Type::ListVolumes,
            rpc::Type::GetCapacity,
            rpc::Type::CreateDeleteSnapshot,
            rpc::Type::ListSnapshots,
            rpc::Type::GetSnapshot,
            rpc::Type::CloneVolume,
            rpc::Type::ExpandVolume,
            rpc::Type::SingleNodeMultiWriter,
        ]
        .into_iter()
        .map(capability)
        .collect();
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn create_snapshot(
        &self,
        request: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        let request = request.into_inner();
        require(&request.name, "name")?;
        require(&request.source_volume_id, "source_volume_id")?;
        if request.name.starts_with(CLONE_SOURCE_PREFIX) {
            return Err(Status::invalid_argument(format!(
                "snapshot names starting with {CLONE_SOURCE_PREFIX:?} are the driver's own"
            )));
        }
        // Idempotent by name, and names are unique across volumes.
        for (volume, snapshot) in self.all_snapshots().await? {
            if snapshot.name == request.name {
                if volume != request.source_volume_id {
                    return Err(Status::already_exists(format!(
                        "snapshot {:?} exists on volume {volume:?}",
                        request.name
                    )));
                }
                return Ok(Response::new(CreateSnapshotResponse {
                    snapshot: Some(csi_snapshot(&volume, &snapshot)),
                }));
            }
        }
        let admin = self.admin_for(&request.source_volume_id).await?;
        let snapshot = admin
            .create_snapshot(&request.source_volume_id, &request.name)
            .await?;
        Ok(Response::new(CreateSnapshotResponse {
            snapshot: Some(csi_snapshot(&request.source_volume_id, &snapshot)),
        }))
    }

    async fn delete_snapshot(
        &self,
        request: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        let id = request.into_inner().snapshot_id;
        require(&id, "snapshot_id")?;
        if let Some((volume, snapshot)) = self.snapshot_by_id(&id).await? {
            let admin = self.admin_for(&volume).await?;
            match admin.delete_snapshot(&volume, &snapshot.name).await {
                Ok(()) => {}
                Err(failure) if failure.not_found() => {}
                Err(failure) => return Err(failure.into()),
            }
        }
        Ok(Response::new(DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        request: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        let request = request.into_inner();
        let snapshots: Vec<(String, SnapshotJson)> = (self.all_snapshots().await?)
            .into_iter()
            .filter(|(volume, snapshot)| {
                (request.snapshot_id.is_empty() || snapshot.guid == request.snapshot_id)
                    && (request.source_volume_id.is_empty() || *volume == request.source_volume_id)
            })
            .collect();
        let (snapshots, next_token) = page(
            snapshots,
            |(_, s)| s.guid.as_str(),
            &request.starting_token,
            request.max_entries,
        )?;
        let entries = snapshots
            .iter()
            .map(|(volume, snapshot)| list_snapshots_response::Entry {
                snapshot: Some(csi_snapshot(volume, snapshot)),
            })
            .collect();
        Ok(Response::new(ListSnapshotsResponse {
            entries,
            next_token,
        }))
    }

    async fn get_snapshot(
        &self,
        request: Request<GetSnapshotRequest>,
    ) -> Result<Response<GetSnapshotResponse>, Status> {
        let id = request.into_inner().snapshot_id;
        require(&id, "snapshot_id")?;
        let (volume, snapshot) = (self.snapshot_by_id(&id).await?)
            .ok_or_else(|| Status::not_found(format!("snapshot {id:?} not found")))?;
        Ok(Response::new(GetSnapshotResponse {
            snapshot: Some(csi_snapshot(&volume, &snapshot)),
        }))
    }

    async fn controller_expand_volume(
        &self,
        request: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        let request = request.into_inner();
        require(&request.volume_id, "volume_id")?;
        let range = request
            .capacity_range
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("capacity_range is required"))?;
        let size = size_for(Some(range))?;
        let volume = (self.admin.volume(&request.volume_id).await?).ok_or_else(|| {
            Status::not_found(format!("volume {:?} not found", request.volume_id))
        })?;
        let capacity = if volume.size_bytes >= size {
            volume.size_bytes
        } else {
            let admin = self.admin_for(&volume.name).await?;
            admin.resize_volume(&volume.name, size).await?;
            size
        };
        // A block volume is its device; a filesystem has to grow on the node.
        let block = request.volume_capability.as_ref().is_some_and(|c| {
            matches!(c.access_type, Some(volume_capability::AccessType::Block(_)))
        });
        Ok(Response::new(ControllerExpandVolumeResponse {
            capacity_bytes: capacity as i64,
            node_expansion_required: !block,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_up_to_blocks_within_the_limit() {
        let range = |required, limit| CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        };
        assert_eq!(size_for(None).ok(), Some(DEFAULT_VOLUME_BYTES));
        assert_eq!(size_for(Some(&range(1, 0))).ok(), Some(4096));
        assert_eq!(size_for(Some(&range(4097, 8192))).ok(), Some(8192));
        assert_eq!(size_for(Some(&range(0, 10_000))).ok(), Some(8192));
        assert_eq!(
            size_for(Some(&range(4097, 5000)))
                .map_err(|s| s.code())
                .err(),
            Some(tonic::Code::OutOfRange)
        );
        assert_eq!(
            size_for(Some(&range(-1, 0))).map_err(|s| s.code()).err(),
            Some(tonic::Code::InvalidArgument)
        );
    }

    #[test]
    fn pages_resume_after_the_last_key_and_refuse_foreign_tokens() {
        let names = || vec!["a", "b", "c", "d", "e"];
        let (first, token) = page(names(), |s| s, "", 2).expect("first page");
        assert_eq!(first, ["a", "b"]);
        assert_eq!(token, "after:b");
        let (second, token) = page(names(), |s| s, &token, 2).expect("second page");
        assert_eq!(second, ["c", "d"]);
        let (last, token) = page(names(), |s| s, &token, 2).expect("last page");
        assert_eq!((last, token.as_str()), (vec!["e"], ""));
        assert_eq!(
            page(names(), |s| s, "7", 2)
                .map(|_| ())
                .map_err(|s| s.code()),
            Err(tonic::Code::Aborted)
        );
    }

    #[test]
    fn parameters_map_to_volume_fields_and_unknown_ones_are_refused() {
        let parameters: HashMap<String, String> = [
            ("compression", "zstd"),
            ("iopsMax", "500"),
            ("replicas", "2"),
            ("csi.storage.k8s.io/pvc/name", "data"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let request = volume_request("v", 4096, &parameters).expect("valid parameters");
        assert_eq!(request["compression"], "zstd");
        assert_eq!(request["iops_max"], 500);
        assert_eq!(request["replicas"], 2);
        let typo: HashMap<String, String> = [("iopsmax".to_string(), "5".to_string())].into();
        assert_eq!(
            volume_request("v", 4096, &typo).map_err(|s| s.code()).err(),
            Some(tonic::Code::InvalidArgument)
        );
    }

    #[test]
    fn addresses_nobody_can_dial_are_not_used() {
        assert!(unspecified("0.0.0.0:3903"));
        assert!(unspecified("[::]:3903"));
        assert!(unspecified("127.0.0.1:0"));
        assert!(!unspecified("127.0.0.2:3903"));
    }

    #[test]
    fn clone_source_snapshots_are_short_and_stable() {
        let long = "x".repeat(128);
        assert_eq!(clone_source_snapshot(&long), clone_source_snapshot(&long));
        assert_ne!(clone_source_snapshot("a"), clone_source_snapshot("b"));
        assert!(clone_source_snapshot(&long).len() < 64);
    }
}
