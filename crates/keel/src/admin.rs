//! The admin API (JSON over HTTP), `/metrics` (Prometheus text) and the dashboard, served by the
//! same binary on the admin address. The CLI talks to this API, never to the data files.
//!
//! Read-only endpoints (`/`, `/metrics`, `GET /api/v1/status`) need no token: they are meant for
//! monitoring on a trusted network. Everything else needs `Authorization: Bearer <token>` with
//! the token from `<first data dir>/admin-token`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use keel_namespace::volume::{VolumeError, VolumeManager, VolumeSpec};
use keel_store::{Compression, Store};
use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::jobs::Jobs;

/// Largest JSON request body the admin API accepts.
const REQUEST_JSON_MAX_BYTES: usize = 64 << 10;
/// Chunks of a send stream buffered between the reader thread and the HTTP body.
const STREAM_CHANNEL_CHUNKS_MAX: usize = 8;
const STREAM_CHUNK_BYTES: usize = 1 << 20;

pub struct AppState {
    pub store: Store,
    pub volumes: Arc<VolumeManager>,
    pub s3: Arc<keel_s3::S3Frontend>,
    pub cluster: Arc<keel_cluster::Cluster>,
    pub replication: Arc<keel_replication::Replication>,
    /// The transport's fault injection, when `--debug-faults` enabled it.
    pub faults: Option<crate::cluster_net::FaultControl>,
    pub token: String,
    pub jobs: Jobs,
    pub scrub: Arc<crate::scrub_schedule::ScrubSchedule>,
    pub sync_window: Arc<crate::sync_health::SyncWindow>,
    pub fill_window: Arc<crate::fill_rate::FillWindow>,
    pub lifecycle: Arc<crate::lifecycle::LifecycleStats>,
    pub config: Config,
    pub started: Instant,
    pub nbd_metrics: crate::metrics::NbdMetrics,
    /// NBD and S3 requests in flight and the recent slowest (`keel ops`).
    pub ops: keel_ops::Ops,
    /// The NBD attaches this node refused lately, with why.
    pub refusals: Arc<crate::refusals::Refusals>,
}

pub type Shared = Arc<AppState>;

/// An error as the API reports it: a status and a message a person can act on.
pub struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(serde_json::json!({ "error": self.1 }))).into_response()
    }
}

impl From<VolumeError> for ApiError {
    fn from(error: VolumeError) -> ApiError {
        let status = match &error {
            VolumeError::NotFound { .. }
            | VolumeError::SnapshotNotFound { .. }
            | VolumeError::Deleted { .. } => StatusCode::NOT_FOUND,
            VolumeError::AlreadyExists { .. }
            | VolumeError::SnapshotExists { .. }
            | VolumeError::InUse { .. } => StatusCode::CONFLICT,
            VolumeError::Invalid { .. }
            | VolumeError::OutOfRange { .. }
            | VolumeError::Stream { .. }
            | VolumeError::BaseMissing { .. } => StatusCode::BAD_REQUEST,
            full if full.is_no_space() => StatusCode::INSUFFICIENT_STORAGE,
            VolumeError::Elsewhere { .. } => StatusCode::MISDIRECTED_REQUEST,
            VolumeError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(status, error.to_string())
    }
}

impl From<keel_s3::FrontendError> for ApiError {
    fn from(error: keel_s3::FrontendError) -> ApiError {
        let text = error.to_string();
        let lower = text.to_lowercase();
        let status = if lower.contains("not found") || lower.contains("no such") {
            StatusCode::NOT_FOUND
        } else if lower.contains("exists") || lower.contains("not empty") {
            StatusCode::CONFLICT
        } else if lower.contains("invalid") {
            StatusCode::BAD_REQUEST
        } else if lower.contains("unavailable") {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::INTERNAL_SERVER_ERROR
        };
        ApiError(status, text)
    }
}

fn internal(error: impl std::fmt::Display) -> ApiError {
    ApiError(StatusCode::INTERNAL_SERVER_ERROR, error.to_string())
}

fn bad_request(message: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, message.into())
}

type ApiResult<T> = Result<T, ApiError>;

/// Runs blocking store work off the async runtime.
async fn blocking<T, F>(work: F) -> ApiResult<T>
where
    F: FnOnce() -> ApiResult<T> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(work).await.map_err(internal)?
}

pub fn router(state: Shared) -> Router {
    let protected = Router::new()
        .route("/api/v1/volumes", get(list_volumes).post(create_volume))
        .route(
            "/api/v1/volumes/{name}",
            get(volume_info).delete(delete_volume),
        )
        .route("/api/v1/volumes/{name}/resize", post(resize_volume))
        .route(
            "/api/v1/volumes/{name}/replication",
            post(set_volume_replication),
        )
        .route("/api/v1/volumes/{name}/hand-off", post(hand_off_volume))
        .route("/api/v1/volumes/{name}/scrub", post(scrub_volume))
        .route(
            "/api/v1/volumes/{name}/snapshots",
            get(list_snapshots).post(create_snapshot),
        )
        .route(
            "/api/v1/volumes/{name}/snapshots/{snapshot}",
            axum::routing::delete(delete_snapshot),
        )
        .route(
            "/api/v1/volumes/{name}/snapshots/{snapshot}/rollback",
            post(rollback_snapshot),
        )
        .route(
            "/api/v1/volumes/{name}/snapshots/{snapshot}/clone",
            post(clone_snapshot),
        )
        .route("/api/v1/volumes/{name}/send", get(send_volume))
        .route("/api/v1/volumes/{name}/receive", post(receive_volume))
        .route("/api/v1/buckets", get(list_buckets).post(create_bucket))
        .route(
            "/api/v1/buckets/{name}",
            get(bucket_info).delete(delete_bucket),
        )
        .route("/api/v1/buckets/{name}/allow", post(allow_bucket))
        .route("/api/v1/keys", get(list_keys).post(create_key))
        .route("/api/v1/keys/{id}", axum::routing::delete(delete_key))
        .route("/api/v1/store/scrub", post(start_scrub))
        .route("/api/v1/store/compact", post(start_compact))
        .route("/api/v1/jobs", get(list_jobs))
        .route("/api/v1/ops", get(list_ops))
        .route("/api/v1/nbd/refusals", get(list_refusals))
        .route("/api/v1/jobs/{id}", get(job_status))
        .route("/api/v1/cluster", get(cluster_status))
        .route("/api/v1/cluster/token", get(cluster_token))
        .route("/api/v1/cluster/leader", post(transfer_leadership))
        .route("/api/v1/s3/lifecycle", post(run_lifecycle))
        .route("/api/v1/nodes", get(list_nodes))
        .route("/api/v1/nodes/{name}", get(node_info).delete(remove_node))
        .route("/api/v1/nodes/{name}/drain", post(drain_node))
        .route("/api/v1/debug/faults", post(set_faults))
        .layer(middleware::from_fn_with_state(state.clone(), require_token));
    Router::new()
        .route("/", get(dashboard))
        .route("/metrics", get(metrics))
        .route("/api/v1/status", get(status))
        .merge(protected)
        .layer(axum::extract::DefaultBodyLimit::max(REQUEST_JSON_MAX_BYTES))
        .layer(middleware::from_fn(read_small_body))
        .with_state(state)
}

/// Reads a small request body (a JSON document) before the handler runs, whether or not the
/// handler takes one: the HTTP server closes a kept-alive connection after answering a request
/// whose body was not read, and a request the client already sent on it (a CLI polling its
/// job) is lost. Streams (`volume receive`, larger or of unknown length) pass through.
async fn read_small_body(request: Request, next: Next) -> Response {
    let small = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<usize>().ok())
        .is_some_and(|length| length > 0 && length <= REQUEST_JSON_MAX_BYTES);
    if !small {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    match axum::body::to_bytes(body, REQUEST_JSON_MAX_BYTES).await {
        Ok(bytes) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Err(error) => ApiError(
            StatusCode::BAD_REQUEST,
            format!("could not read the request body: {error}"),
        )
        .into_response(),
    }
}

async fn require_token(State(state): State<Shared>, request: Request, next: Next) -> Response {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if !constant_time_eq(presented.as_bytes(), state.token.as_bytes()) {
        return ApiError(
            StatusCode::UNAUTHORIZED,
            "missing or wrong admin token (see <data dir>/admin-token or KEEL_ADMIN_TOKEN)".into(),
        )
        .into_response();
    }
    next.run(request).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

// ---------------------------------------------------------------------------------------------
// Status and metrics.

#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct StatusReport {
    pub health: String,
    /// One line per check: `CODE: what (what to do)`.
    pub reasons: Vec<String>,
    /// The same checks with their code, severity (`error`, `warn`, `info`), message and action.
    pub checks: Vec<keel_cluster::HealthCheck>,
    /// Each data directory's filesystem, device and write cache.
    pub devices: Vec<DeviceStatus>,
    pub version: String,
    pub uptime_seconds: u64,
    pub data: Vec<String>,
    pub mirrored: bool,
    pub ephemeral: bool,
    pub s3: String,
    pub nbd: String,
    pub admin: String,
    pub store: StoreStatus,
    pub volumes: usize,
    pub buckets: usize,
    /// The cluster as this node sees it: nodes, roles, liveness, health findings.
    pub cluster: keel_cluster::ClusterStatus,
    /// Scheduled scrubs: the interval, when the next is due, the last one's outcome.
    pub scrub: crate::scrub_schedule::ScrubStatus,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct DeviceStatus {
    pub dir: String,
    pub filesystem: String,
    /// The block device under it, when it is one.
    pub device: Option<String>,
    /// Its write cache: `write back` (volatile) or `write through`.
    pub write_cache: Option<String>,
    pub total_bytes: u64,
    pub available_bytes: u64,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct StoreStatus {
    pub live_extents: u64,
    pub live_raw_bytes: u64,
    pub live_stored_bytes: u64,
    pub compression_ratio: f64,
    pub log_bytes: u64,
    pub segments: u64,
    pub last_seq: u64,
    pub log_syncs: u64,
    pub corrupt_reads: u64,
    pub repaired_extents: u64,
    pub poisoned: bool,
    pub available_bytes: u64,
    pub location_cache_hits: u64,
    pub location_cache_misses: u64,
    /// Bytes of closed segments no live extent uses: what compaction can return.
    pub dead_bytes: u64,
    /// Free space kept back from writes that add data.
    pub reserve_bytes: u64,
    /// How fast the fullest data directory fills, once sampled for ten minutes.
    pub fill: Option<crate::fill_rate::FillEstimate>,
}

/// The volume replicas a drain of a node has left to move; among them, a replicated volume's
/// primary (handed to another replica in sync first) and a volume's only copy (copied to another
/// node first, R staying 1, then handed to the copy).
struct DrainLeft {
    replicas: usize,
    primaries: usize,
    single_copies: usize,
    /// Volumes whose replica cannot leave as things are, with why
    /// ([`keel_catalog::CatalogState::drain_waits`]).
    waiting: Vec<(String, Vec<keel_catalog::DrainWait>)>,
}

/// Volumes named in one health message: this many at most ([`first_named`]).
const NAMED_MAX: usize = 5;

/// The first [`NAMED_MAX`] of `names`, then "and N more" for the rest.
fn first_named(mut names: Vec<String>) -> Vec<String> {
    if names.len() > NAMED_MAX {
        let more = names.len() - NAMED_MAX;
        names.truncate(NAMED_MAX);
        names.push(format!("and {more} more"));
    }
    names
}

impl DrainLeft {
    fn of(catalog: &keel_catalog::CatalogState, node: keel_catalog::NodeId) -> DrainLeft {
        let held: Vec<&keel_catalog::Replication> = (catalog.volumes.values())
            .map(|entry| &entry.record.replication)
            .filter(|replication| replication.replicas.contains(&node))
            .collect();
        let primaries = |single: bool| {
            (held.iter())
                .filter(|replication| {
                    replication.primary == node && (replication.replicas.len() == 1) == single
                })
                .count()
        };
        DrainLeft {
            replicas: held.len(),
            primaries: primaries(false),
            single_copies: primaries(true),
            waiting: catalog.drain_waits(node),
        }
    }

    /// "; N of them wait: volume V: why; ..." for the volumes it cannot move yet (the first
    /// [`NAMED_MAX`]), or nothing.
    fn waiting_sentence(&self) -> String {
        if self.waiting.is_empty() {
            return String::new();
        }
        let named = first_named(
            (self.waiting.iter())
                .map(|(volume, waits)| format!("volume {volume}: {}", describe_waits(waits)))
                .collect(),
        );
        format!(
            "; {} of them cannot move as things are: {}",
            self.waiting.len(),
            named.join("; ")
        )
    }
}

fn describe_waits(waits: &[keel_catalog::DrainWait]) -> String {
    (waits.iter())
        .map(|wait| wait.describe())
        .collect::<Vec<_>>()
        .join(", and ")
}

/// One finding (warn) per other storage node recorded as nearly full: it takes no new replica
/// (placement skips it, Raft refuses one onto it). This node's own shows as `KEEL_NEARFULL`.
fn nearfull_nodes(state: &AppState) -> Vec<keel_cluster::HealthCheck> {
    let local = keel_catalog::Metadata::local_node(state.cluster.as_ref());
    let catalog = state.cluster.catalog().read();
    (catalog.nearfull.iter())
        .filter(|node| **node != local)
        .filter_map(|node| catalog.nodes.get(node))
        .filter(|record| !record.removed)
        .map(|record| {
            check(
                "KEEL_NODE_NEARFULL",
                "warn",
                format!(
                    "node {} is nearly full (a data directory over its nearfull_percent used, \
                     or with less than twice the store's reserve free): it takes no new \
                     replica, so rebuilds, moves and drains place replicas on other nodes",
                    record.name
                ),
                format!(
                    "free space or add a device on {}; keel node list shows each node's free \
                     space and provisioned volumes",
                    record.name
                ),
            )
        })
        .collect()
}

/// Clients attached through this node whose I/O is forwarded to another node: after a drain,
/// a move of the primary's replica or a hand-off, or attached where no replica is. They work,
/// one network round trip slower per request, which nothing else would show.
fn forwarded_clients(state: &AppState) -> Option<keel_cluster::HealthCheck> {
    let forwarded = state.replication.forwarded_clients();
    if forwarded.is_empty() {
        return None;
    }
    let named = {
        let catalog = state.cluster.catalog().read();
        first_named(
            (forwarded.iter())
                .map(|clients| {
                    let node = (catalog.nodes.get(&clients.node))
                        .map_or_else(|| clients.node.to_string(), |node| node.name.clone());
                    format!("{:?} to node {node}", clients.export)
                })
                .collect(),
        )
    };
    Some(check(
        "KEEL_VOLUME_FORWARDED",
        "info",
        format!(
            "{} client handle(s) attached through this node forward every request to another \
             node, one more network round trip each: {}",
            forwarded
                .iter()
                .map(|clients| clients.handles)
                .sum::<usize>(),
            named.join(", ")
        ),
        "attach those clients through the node named (it serves the volume: their I/O is then \
         local), or another node holding a replica (keel volume info NAME names them)"
            .to_string(),
    ))
}

/// One finding (info) per node draining: what it has left to move, or that it is drained.
fn drains(state: &AppState) -> Vec<keel_cluster::HealthCheck> {
    let catalog = state.cluster.catalog().read();
    (catalog.nodes.values())
        .filter(|record| record.draining && !record.removed)
        .map(|record| {
            let left = DrainLeft::of(&catalog, record.id);
            if left.replicas == 0 {
                return check(
                    "KEEL_NODE_DRAINING",
                    "info",
                    format!(
                        "node {} is drained: it holds no volume replica",
                        record.name
                    ),
                    format!(
                        "keel node remove {} once it is no longer needed",
                        record.name
                    ),
                );
            }
            check(
                "KEEL_NODE_DRAINING",
                "info",
                format!(
                    "node {} is draining: {} volume replica(s) left, {} of them a replicated \
                     volume's primary (handed to another replica in sync first) and {} a \
                     volume's only copy (copied to another node first, R staying 1){}",
                    record.name,
                    left.replicas,
                    left.primaries,
                    left.single_copies,
                    left.waiting_sentence()
                ),
                format!(
                    "keel node info {} lists them; attach clients forwarded through this node \
                     through another",
                    record.name
                ),
            )
        })
        .collect()
}

/// Replicated volumes with fewer replicas in sync than wanted: (code, severity, message,
/// action) per volume. Each replica behind is named with what holds it back: its node down or
/// nearly full (the catalog), and the primary's word on its catch-up (how far it got, why a
/// try failed): this node's own, or what `primaries` holds of a primary elsewhere.
fn volume_redundancy(
    state: &AppState,
    primaries: &RemotePrimaries,
) -> Vec<(&'static str, &'static str, String, String)> {
    struct Behind {
        node: keel_catalog::NodeId,
        name: String,
        /// Why its node cannot take anything now: removed, down, not answering.
        gone: Option<&'static str>,
        nearfull: bool,
    }
    let degraded: Vec<(u64, keel_catalog::VolumeRecord, Vec<Behind>)> = {
        let catalog = state.cluster.catalog().read();
        (catalog.volumes.iter())
            .filter(|(_, entry)| {
                let replication = &entry.record.replication;
                entry.record.status == keel_catalog::VolumeStatus::Ready
                    && replication.in_sync.len() < usize::from(replication.factor)
            })
            .map(|(id, entry)| {
                let replication = &entry.record.replication;
                let behind = (replication.replicas.iter())
                    .filter(|node| !replication.in_sync.contains(node))
                    .map(|node| {
                        let record = catalog.nodes.get(node);
                        Behind {
                            node: *node,
                            name: record.map(|r| r.name.clone()).unwrap_or_default(),
                            gone: match record {
                                None => Some("unknown"),
                                Some(r) if r.removed => Some("removed"),
                                Some(r) => match r.state {
                                    keel_catalog::NodeState::Up => None,
                                    keel_catalog::NodeState::Suspect => Some("not answering"),
                                    keel_catalog::NodeState::Down => Some("down"),
                                },
                            },
                            nearfull: catalog.nearfull.contains(node),
                        }
                    })
                    .collect();
                (*id, entry.record.clone(), behind)
            })
            .collect()
    };
    let mut findings = Vec::new();
    for (volume_id, record, behind) in degraded {
        let replication = &record.replication;
        let in_sync = replication.in_sync.len();
        let (code, severity) = if in_sync < usize::from(replication.in_sync_min) {
            ("KEEL_VOLUME_BELOW_MIN_IN_SYNC", "error")
        } else {
            ("KEEL_VOLUME_DEGRADED", "warn")
        };
        let (served, unasked) = match state.replication.primary_status(volume_id) {
            Some(status) => (Some(status), None),
            None => match primaries.get(&volume_id) {
                Some(Ok(status)) => (status.clone(), None),
                Some(Err(why)) => (None, Some(why.clone())),
                None => (None, None),
            },
        };
        let mut described: Vec<String> = (behind.iter())
            .map(|replica| {
                let mut why = Vec::new();
                if !replica.name.is_empty() {
                    why.push(replica.name.clone());
                }
                why.extend(replica.gone.map(str::to_string));
                if replica.nearfull {
                    why.push("nearly full".to_string());
                }
                let catch_up = (served.iter())
                    .flat_map(|status| &status.catching_up)
                    .find(|catch_up| catch_up.node == replica.node);
                why.extend(catch_up.into_iter().flat_map(catch_up_words));
                format!("node {} ({})", replica.node, why.join("; "))
            })
            .collect();
        if let Some(why) = unasked {
            described.push(format!(
                "(its primary could not say how its catch-ups go: {why})"
            ));
        }
        let remedy = if behind.iter().any(|replica| replica.nearfull) {
            "free space on the nearly full node (its replica catches up on its own once there \
             is room); a replica refusing its catch-ups for cluster.replica_move_after_ms \
             moves on its own to another storage node with room, if there is one (add one)"
        } else if behind.iter().any(|replica| replica.gone.is_some()) {
            "bring the node back: its replica catches up on its own"
        } else {
            "nothing, if its catch-up progresses (keel status shows how far it got, and why \
             a try failed; keel volume info too)"
        };
        findings.push((
            code,
            severity,
            format!(
                "volume {:?} has {in_sync} of {} replicas in sync (minimum {}); behind: {}",
                record.name,
                replication.factor,
                replication.in_sync_min,
                described.join(", ")
            ),
            if code == "KEEL_VOLUME_BELOW_MIN_IN_SYNC" {
                format!(
                    "writes are refused: {remedy}; or accept less redundancy with keel volume \
                     set-replication {} --min-in-sync {}",
                    record.name,
                    in_sync.max(1)
                )
            } else {
                remedy.to_string()
            },
        ));
    }
    findings
}

/// What a primary's status says of one replica it catches up: how far the comparison got
/// (or that it waits for a turn to copy the whole volume; nothing of a try that failed while
/// the next has not begun), and why the last try failed.
fn catch_up_words(catch_up: &keel_replication::primary::CatchUp) -> Vec<String> {
    let mut words = Vec::new();
    if catch_up.waiting_for_turn {
        words.push("waiting for a turn to copy the whole volume".to_string());
    } else if catch_up.total_bytes > 0
        && (catch_up.last_failure.is_none() || catch_up.eta_seconds.is_some())
    {
        let left = catch_up
            .eta_seconds
            .map(|seconds| format!(", about {seconds} s left"))
            .unwrap_or_default();
        words.push(format!(
            "catching up: {} of {} compared ({}%){left}",
            crate::cli::human_bytes(catch_up.compared_bytes),
            crate::cli::human_bytes(catch_up.total_bytes),
            u128::from(catch_up.compared_bytes) * 100 / u128::from(catch_up.total_bytes)
        ));
    }
    if let Some(last) = &catch_up.last_failure {
        words.push(format!(
            "its catch-up failed {} time(s) in a row, the last {} s ago: {last}",
            catch_up.failures,
            catch_up.last_failure_seconds_ago.unwrap_or(0)
        ));
    }
    words
}

/// Ready volumes with one replica, on this node: how many, and the first few names.
fn single_copy_volumes(state: &AppState) -> (usize, Vec<String>) {
    const NAMES_SHOWN_MAX: usize = 10;
    let here = state.cluster.node_id();
    let catalog = state.cluster.catalog().read();
    let mut names: Vec<String> = catalog
        .volumes
        .values()
        .map(|entry| &entry.record)
        .filter(|record| {
            record.status == keel_catalog::VolumeStatus::Ready
                && record.replication.factor == 1
                && record.replication.replicas.contains(&here)
        })
        .map(|record| record.name.clone())
        .collect();
    names.sort();
    let count = names.len();
    if count > NAMES_SHOWN_MAX {
        names.truncate(NAMES_SHOWN_MAX);
        names.push(format!("and {} more", count - NAMES_SHOWN_MAX));
    }
    (count, names)
}

/// One health finding.
fn check(
    code: &str,
    severity: &str,
    message: String,
    action: impl Into<String>,
) -> keel_cluster::HealthCheck {
    keel_cluster::HealthCheck {
        code: code.to_string(),
        severity: severity.to_string(),
        message,
        action: action.into(),
    }
}

pub fn status_report(
    state: &AppState,
    cluster: keel_cluster::ClusterStatus,
    primaries: &RemotePrimaries,
) -> ApiResult<StatusReport> {
    let stats = state.store.stats().map_err(internal)?;
    let mut checks: Vec<keel_cluster::HealthCheck> = cluster.health.clone();
    for (code, severity, message, action) in volume_redundancy(state, primaries) {
        checks.push(check(code, severity, message, action));
    }
    checks.extend(drains(state));
    checks.extend(nearfull_nodes(state));
    checks.extend(forwarded_clients(state));
    let waiting = state.replication.rebuilds_waiting();
    if !waiting.is_empty() {
        let named = first_named(
            (waiting.iter())
                .map(|wait| format!("{:?} to node {}", wait.volume, wait.node))
                .collect(),
        );
        checks.push(check(
            "KEEL_REBUILDS_WAITING",
            "info",
            format!(
                "{} whole-volume copies from this node wait for a turn (cluster.rebuilds_max = \
                 {} run at once from a node, and to one): {}; their replicas stay out of sync \
                 until then",
                waiting.len(),
                state.replication.rebuilds_max(),
                named.join(", ")
            ),
            "nothing to do: each starts when a copy ends (keel volume info shows progress); \
             raise cluster.rebuilds_max (on every node) to run more at once"
                .to_string(),
        ));
    }
    for held in state.replication.held_replicas() {
        checks.push(check(
            "KEEL_REPLICA_MOVE_HELD",
            "warn",
            format!(
                "volume {:?}'s replica stays on node {}, which is down, draining or removed: \
                 that node alone holds snapshot(s) {} whole, and moving the replica would \
                 lose them",
                held.volume,
                held.node,
                keel_replication::quoted(&held.snapshots)
            ),
            format!(
                "bring node {} back (with cluster.snapshot_repair on, the snapshots are copied \
                 to the other replicas and the replica then moves), or delete those snapshots \
                 of {:?}",
                held.node, held.volume
            ),
        ));
    }
    if stats.poisoned {
        checks.push(check(
            "KEEL_STORE_POISONED",
            "error",
            "a failed sync stopped the store's writes (the kernel may have dropped the data it \
             held); reads still work"
                .to_string(),
            "the server stops itself for its supervisor to restart it (the restart replays the \
             log); check the device (dmesg, SMART)",
        ));
    }
    if stats.corrupt_reads > stats.repaired_extents {
        checks.push(check(
            "KEEL_CHECKSUM_FAILURES",
            "warn",
            format!(
                "{} checksum failures on read, {} repaired from a mirror",
                stats.corrupt_reads, stats.repaired_extents
            ),
            "run keel store scrub; replace the device if failures keep coming",
        ));
    }
    if let Some(finding) = state
        .sync_window
        .finding(&stats.sync_latency, state.config.slow_sync_ms)
    {
        checks.push(finding);
    }
    let scrub = state.scrub.status();
    if let Some(run) = scrub
        .last
        .as_ref()
        .filter(|run| run.unrecoverable_extents > 0)
    {
        checks.push(check(
            "KEEL_SCRUB_ERRORS",
            "error",
            format!(
                "the last scheduled scrub found {} extents with no good copy on this node",
                run.unrecoverable_extents
            ),
            "restore what they hold from a backup or a replica; keel store scrub lists their keys",
        ));
    }
    if state.config.ephemeral {
        checks.push(check(
            "KEEL_EPHEMERAL",
            "warn",
            "running --ephemeral: data may be on a volatile filesystem".to_string(),
            "throwaway data only: restart without --ephemeral on a real disk to keep data",
        ));
    }
    let fill = state.fill_window.estimate();
    let mut available = u64::MAX;
    let mut devices = Vec::new();
    for dir in &state.config.data {
        let Ok(info) = keel_store::fsinfo::filesystem_info(dir) else {
            continue;
        };
        available = available.min(info.available_bytes);
        let limit = state.config.nearfull_percent;
        let usage = crate::nearfull::Usage::of(&info);
        let reserve = stats.reserve_bytes;
        let days = fill
            .as_ref()
            .and_then(|fill| fill.days_to_full)
            .map(|days| format!(", full in about {days:.1} days at the recent rate"))
            .unwrap_or_default();
        let free = crate::cli::human_bytes(usage.available);
        if usage.full(reserve) {
            checks.push(check(
                "KEEL_FULL",
                "error",
                format!(
                    "{} has {free} free, at the {} the store keeps in reserve: writes that add \
                     data are refused (volume writes, object uploads, the copies of replicas \
                     this node holds)",
                    dir.display(),
                    crate::cli::human_bytes(reserve)
                ),
                "free space (delete volumes, snapshots or objects, then keel store compact) or \
                 add a device; a replica here catches up on its own once there is room",
            ));
        } else if crate::nearfull::over_percent(&usage, limit, false) {
            checks.push(check(
                "KEEL_NEARFULL",
                "warn",
                format!(
                    "{} is {}% used, over the {limit}% warning level{days}",
                    dir.display(),
                    usage.percent_used()
                ),
                "free space or add a device; keel store compact returns what deleted data held",
            ));
        } else if crate::nearfull::nearly_full(&[usage], limit, reserve, false) {
            checks.push(check(
                "KEEL_NEARFULL",
                "warn",
                format!(
                    "{} has {free} free, under twice the {} the store keeps in reserve (it \
                     refuses writes at the reserve){days}",
                    dir.display(),
                    crate::cli::human_bytes(reserve)
                ),
                "free space or add a device; keel store compact returns what deleted data held",
            ));
        }
        let cache = keel_store::fsinfo::write_cache(dir);
        if let Some(cache) = cache.as_ref().filter(|cache| cache.volatile()) {
            checks.push(check(
                "KEEL_VOLATILE_WRITE_CACHE",
                "info",
                format!(
                    "{} under {} has a volatile write cache ({}): acknowledged writes survive a \
                     power cut only if the drive honours the cache flushes Keel's fdatasync sends",
                    cache.device,
                    dir.display(),
                    cache.mode
                ),
                "use drives with power-loss protection; keel doctor examines the device",
            ));
        }
        devices.push(DeviceStatus {
            dir: dir.display().to_string(),
            filesystem: info.filesystem.clone(),
            device: cache.as_ref().map(|cache| cache.device.clone()),
            write_cache: cache.as_ref().map(|cache| cache.mode.clone()),
            total_bytes: info.total_bytes,
            available_bytes: info.available_bytes,
        });
    }
    if state.config.data.len() == 1 {
        let (count, names) = single_copy_volumes(state);
        if count > 0 {
            checks.push(check(
                "KEEL_UNPROTECTED_VOLUMES",
                "info",
                format!(
                    "{count} volume(s) have their only copy on this node's single data \
                     directory: {}",
                    names.join(", ")
                ),
                "a failed device loses them: raise their replicas (keel volume set-replication \
                 NAME --replicas 2) or add a mirror directory",
            ));
        }
        checks.push(check(
            "KEEL_NO_LOCAL_MIRROR",
            "info",
            "a single data directory: a failed device loses the data only this node holds"
                .to_string(),
            "give a second --data directory on another device for a local mirror, or keep \
             volumes on several nodes (keel volume set-replication NAME --replicas 2)",
        ));
    }
    let level = checks
        .iter()
        .map(|check| match check.severity.as_str() {
            "error" => 2,
            "warn" => 1,
            _ => 0,
        })
        .max()
        .unwrap_or(0);
    let reasons = checks
        .iter()
        .map(|check| format!("{}: {} ({})", check.code, check.message, check.action))
        .collect();
    Ok(StatusReport {
        health: ["HEALTH_OK", "HEALTH_WARN", "HEALTH_ERR"][level].to_string(),
        reasons,
        checks,
        devices,
        version: env!("CARGO_PKG_VERSION").to_string(),
        uptime_seconds: state.started.elapsed().as_secs(),
        data: state
            .config
            .data
            .iter()
            .map(|d| d.display().to_string())
            .collect(),
        mirrored: state.config.data.len() > 1,
        ephemeral: state.config.ephemeral,
        s3: state.config.s3.to_string(),
        nbd: state.config.nbd.to_string(),
        admin: state.config.admin.to_string(),
        store: StoreStatus {
            live_extents: stats.live_extents,
            live_raw_bytes: stats.live_raw_bytes,
            live_stored_bytes: stats.live_stored_bytes,
            compression_ratio: stats.compression_ratio(),
            log_bytes: stats.log_bytes,
            segments: stats.segments,
            last_seq: stats.last_seq,
            log_syncs: stats.log_syncs,
            corrupt_reads: stats.corrupt_reads,
            repaired_extents: stats.repaired_extents,
            poisoned: stats.poisoned,
            available_bytes: if available == u64::MAX { 0 } else { available },
            location_cache_hits: stats.location_cache_hits,
            location_cache_misses: stats.location_cache_misses,
            dead_bytes: stats.dead_bytes,
            reserve_bytes: stats.reserve_bytes,
            fill,
        },
        volumes: state.volumes.list().len(),
        buckets: state.s3.list_buckets().len(),
        cluster,
        scrub,
    })
}

async fn status(State(state): State<Shared>) -> ApiResult<Json<StatusReport>> {
    let cluster = state.cluster.status().await;
    let primaries = degraded_primaries(&state).await;
    blocking(move || status_report(&state, cluster, &primaries).map(Json)).await
}

/// Degraded volumes whose primary elsewhere `keel status` asks at once (the others' findings
/// name their replicas' nodes' state only).
const PRIMARIES_ASKED_MAX: usize = 64;

/// What their primaries say of the degraded volumes this node does not serve (how far each
/// replica's catch-up got, its ETA, why a try failed), asked all at once: volume id → the
/// primary's status, or why it could not be asked.
async fn degraded_primaries(state: &Shared) -> RemotePrimaries {
    let degraded: Vec<u64> = {
        let catalog = state.cluster.catalog().read();
        (catalog.ready_volumes())
            .filter(|entry| {
                let replication = &entry.record.replication;
                replication.in_sync.len() < usize::from(replication.factor)
            })
            .map(|entry| entry.record.id)
            .filter(|id| state.replication.primary_status(*id).is_none())
            .take(PRIMARIES_ASKED_MAX)
            .collect()
    };
    let mut asked = tokio::task::JoinSet::new();
    for volume_id in degraded {
        let replication = state.replication.clone();
        asked.spawn(async move {
            let answer = replication.primary_status_anywhere(volume_id).await;
            (volume_id, answer)
        });
    }
    let mut primaries = RemotePrimaries::new();
    while let Some(answered) = asked.join_next().await {
        if let Ok((volume_id, answer)) = answered {
            primaries.insert(volume_id, answer);
        }
    }
    primaries
}

/// Volume id → the status its primary on another node gave, or why it could not be asked
/// (`Ok(None)`: no node serves the volume now).
type RemotePrimaries =
    BTreeMap<u64, Result<Option<keel_replication::primary::PrimaryStatus>, String>>;

/// `/metrics`: OpenMetrics for scrapers that ask for it (Prometheus does), the classic text
/// format otherwise.
async fn metrics(State(state): State<Shared>, headers: HeaderMap) -> ApiResult<Response> {
    let openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .any(|value| value.contains("application/openmetrics-text"));
    let cluster = state.cluster.status().await;
    let nbd_metrics = state.nbd_metrics.clone();
    let s3_metrics = state.s3.metrics().clone();
    let sync_latency = state.store.sync_latency();
    let device_sync_latency = state.store.device_sync_latency();
    let commit_batches = state.store.commit_batches();
    let throttled = state.volumes.throttled();
    let jobs = state.jobs.list();
    let lifecycle = state.lifecycle.clone();
    let process = crate::process::read()
        .inspect_err(|error| tracing::warn!(%error, "reading /proc/self for /metrics"))
        .ok();
    // (Without the primaries' own view of degraded volumes: a scrape asks no other node.)
    let report = blocking(move || status_report(&state, cluster, &RemotePrimaries::new())).await?;
    let disks: Vec<crate::metrics::DeviceCounters> = report
        .devices
        .iter()
        .filter_map(|device| {
            let name = device.device.as_ref()?;
            let stats = crate::diskstats::read(name)
                .inspect_err(|error| tracing::warn!(%error, "reading /proc/diskstats"))
                .ok()??;
            Some(crate::metrics::DeviceCounters {
                dir: device.dir.clone(),
                device: name.clone(),
                stats,
            })
        })
        .collect();
    let readings = crate::metrics::Readings {
        lifecycle,
        sync_latency,
        device_sync_latency,
        commit_batches,
        throttled,
        jobs,
        disks,
        process,
    };
    let text =
        crate::metrics::render(&report, &nbd_metrics, &s3_metrics, &readings).map_err(internal)?;
    let (content_type, text) = if openmetrics {
        (
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            text,
        )
    } else {
        (
            "text/plain; version=0.0.4; charset=utf-8",
            crate::metrics::classic_text(&text),
        )
    };
    Ok(([(header::CONTENT_TYPE, content_type)], text).into_response())
}

async fn dashboard() -> Html<&'static str> {
    Html(include_str!("dashboard.html"))
}

// ---------------------------------------------------------------------------------------------
// Volumes and snapshots.

#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct VolumeJson {
    pub name: String,
    pub size_bytes: u64,
    pub compression: String,
    pub iops_max: Option<u64>,
    pub bandwidth_max_mib_per_second: Option<u64>,
    pub generation: u64,
    pub snapshots: usize,
    pub origin: Option<String>,
    pub used_bytes: Option<u64>,
    pub stored_bytes: Option<u64>,
    /// The node serving the volume and the nodes holding its replicas (ids), as Raft records
    /// them: any node lists them, so a client finds where to send the volume's operations.
    #[serde(default)]
    pub primary: Option<u64>,
    #[serde(default)]
    pub replicas: Vec<u64>,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct SnapshotJson {
    pub name: String,
    pub guid: String,
    pub generation: u64,
    pub size_bytes: u64,
    pub created_unix_seconds: u64,
    /// `None` when the list was asked without usage (`?usage=false`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub referenced_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unique_bytes: Option<u64>,
    /// Replicas (node ids) whose copy of the snapshot lacks data: it is served, rolled back
    /// onto and sent only through the others.
    #[serde(default)]
    pub incomplete_on: Vec<u64>,
}

fn volume_json(summary: &keel_namespace::volume::VolumeSummary) -> VolumeJson {
    VolumeJson {
        name: summary.name.clone(),
        size_bytes: summary.size_bytes,
        compression: summary.compression.name().to_string(),
        iops_max: summary.iops_max,
        bandwidth_max_mib_per_second: summary.bandwidth_max_mib_per_second,
        generation: summary.generation,
        snapshots: summary.snapshots,
        origin: summary.origin.as_ref().map(|(v, s)| format!("{v}@{s}")),
        used_bytes: None,
        stored_bytes: None,
        primary: None,
        replicas: Vec::new(),
    }
}

fn snapshot_json(info: &keel_namespace::volume::SnapshotInfo) -> SnapshotJson {
    SnapshotJson {
        name: info.name.clone(),
        guid: info.guid.clone(),
        generation: info.generation,
        size_bytes: info.size_bytes,
        created_unix_seconds: info.created_unix_seconds,
        referenced_bytes: info.referenced_bytes,
        unique_bytes: info.unique_bytes,
        incomplete_on: info.incomplete_on.clone(),
    }
}

#[derive(Deserialize)]
pub struct CreateVolume {
    pub name: String,
    pub size_bytes: u64,
    pub compression: Option<String>,
    pub iops_max: Option<u64>,
    pub bandwidth_max_mib_per_second: Option<u64>,
    /// Replicas (R), on distinct nodes; 1 when absent.
    pub replicas: Option<u8>,
}

pub fn parse_compression(name: Option<&str>) -> ApiResult<Compression> {
    match name {
        None => Ok(Compression::None),
        Some(name) => Compression::from_name(name).ok_or_else(|| {
            bad_request(format!(
                "unknown compression {name:?}: use none, lz4 or zstd"
            ))
        }),
    }
}

async fn list_volumes(State(state): State<Shared>) -> Json<Vec<VolumeJson>> {
    let summaries = state.volumes.list();
    let catalog = state.cluster.catalog().read();
    Json(
        summaries
            .iter()
            .map(|summary| {
                let mut volume = volume_json(summary);
                if let Some(entry) = catalog.volumes.get(&summary.id) {
                    volume.primary = Some(entry.record.replication.primary);
                    volume.replicas = entry.record.replication.replicas.clone();
                }
                volume
            })
            .collect(),
    )
}

async fn create_volume(
    State(state): State<Shared>,
    Json(request): Json<CreateVolume>,
) -> ApiResult<Json<VolumeJson>> {
    let mut spec = VolumeSpec::new(&request.name, request.size_bytes);
    spec.compression = parse_compression(request.compression.as_deref())?;
    spec.iops_max = request.iops_max;
    spec.bandwidth_max_mib_per_second = request.bandwidth_max_mib_per_second;
    spec.replicas = request.replicas.unwrap_or(1);
    blocking(move || Ok(Json(volume_json(&state.volumes.create(&spec)?)))).await
}

/// A volume's replication as Raft records it, and as this node serves it when it is the
/// primary (replicas catching up, bytes shipped to them).
fn replication_json(state: &AppState, volume_id: u64) -> serde_json::Value {
    let record = state
        .cluster
        .catalog()
        .read()
        .volumes
        .get(&volume_id)
        .map(|entry| entry.record.replication.clone());
    let Some(replication) = record else {
        return serde_json::Value::Null;
    };
    let served = state.replication.primary_status(volume_id);
    serde_json::json!({
        "factor": replication.factor,
        "in_sync_min": replication.in_sync_min,
        "replicas": replication.replicas,
        "epoch": replication.epoch,
        "primary": replication.primary,
        "in_sync": replication.in_sync,
        "served_here": served,
        "received_bytes": state.replication.counters().received_bytes(),
    })
}

async fn volume_info(
    State(state): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    // A replicated volume's primary, wherever it runs, on its catch-ups.
    let replicated = (state.cluster.catalog().read().volume(&name))
        .filter(|entry| entry.record.replication.replicas.len() > 1)
        .map(|entry| entry.record.id);
    let primary = match replicated {
        Some(volume_id) => Some(state.replication.primary_status_anywhere(volume_id).await),
        None => None,
    };
    blocking(move || {
        let info = state.volumes.info(&name)?;
        let mut volume = volume_json(&info.summary);
        volume.used_bytes = Some(info.used_bytes);
        volume.stored_bytes = Some(info.stored_bytes);
        let snapshots: Vec<SnapshotJson> = info.snapshots.iter().map(snapshot_json).collect();
        let mut replication = replication_json(&state, info.summary.id);
        if let (Some(primary), Some(fields)) = (primary, replication.as_object_mut()) {
            let (status, error) = match primary {
                Ok(status) => (serde_json::json!(status), serde_json::Value::Null),
                Err(why) => (serde_json::Value::Null, serde_json::json!(why)),
            };
            fields.insert("primary_status".to_string(), status);
            fields.insert("primary_status_error".to_string(), error);
        }
        Ok(Json(
            serde_json::json!({ "volume": volume, "snapshots": snapshots, "replication": replication }),
        ))
    })
    .await
}

#[derive(Deserialize)]
pub struct Resize {
    pub size_bytes: u64,
    #[serde(default)]
    pub allow_shrink: bool,
}

async fn resize_volume(
    State(state): State<Shared>,
    Path(name): Path<String>,
    Json(request): Json<Resize>,
) -> ApiResult<Json<serde_json::Value>> {
    blocking(move || {
        state.replication.quiesce(&name, || {
            state
                .volumes
                .resize(&name, request.size_bytes, request.allow_shrink)
        })?;
        Ok(Json(
            serde_json::json!({ "name": name, "size_bytes": request.size_bytes }),
        ))
    })
    .await
}

#[derive(Deserialize)]
pub struct SetReplication {
    pub replicas: Option<u8>,
    pub in_sync_min: Option<u8>,
    /// Raising R: the node (name or id) the first new replica goes to.
    pub add_to: Option<String>,
    /// Lowering R: the node (name or id) whose replica leaves first.
    pub remove_from: Option<String>,
}

async fn set_volume_replication(
    State(state): State<Shared>,
    Path(name): Path<String>,
    Json(request): Json<SetReplication>,
) -> ApiResult<Json<serde_json::Value>> {
    let node_id = |node: &Option<String>| -> ApiResult<Option<keel_catalog::NodeId>> {
        node.as_deref()
            .map(|node| find_node(&state, node).map(|record| record.id))
            .transpose()
    };
    let placement = keel_replication::Placement {
        add_to: node_id(&request.add_to)?,
        remove_from: node_id(&request.remove_from)?,
    };
    blocking(move || {
        state
            .replication
            .set_replicas(&name, request.replicas, request.in_sync_min, placement)?;
        Ok(replication_answer(&state, &name))
    })
    .await
}

/// Volume `name`'s replication after a change, as `volume info` shows it (null if the volume
/// was deleted meanwhile).
fn replication_answer(state: &Shared, name: &str) -> Json<serde_json::Value> {
    let volume_id = (state.cluster.catalog().read())
        .volume(name)
        .map(|entry| entry.record.id);
    Json(
        volume_id
            .map(|id| replication_json(state, id))
            .unwrap_or_default(),
    )
}

#[derive(Deserialize)]
pub struct HandOff {
    /// The node (name or id) of the replica in sync that becomes the primary.
    pub to: String,
}

/// Makes another replica in sync the volume's primary, on its primary (elsewhere: 421 with
/// the primary's address); clients attached here go on forwarded to it.
async fn hand_off_volume(
    State(state): State<Shared>,
    Path(name): Path<String>,
    Json(request): Json<HandOff>,
) -> ApiResult<Json<serde_json::Value>> {
    let to = find_node(&state, &request.to)?.id;
    blocking(move || {
        state.replication.hand_off(&name, to)?;
        Ok(replication_answer(&state, &name))
    })
    .await
}

/// Compares a replicated volume's replicas and repairs what differs, as a job, on its primary
/// (elsewhere: 421 with the primary's address, before any job starts).
async fn scrub_volume(
    State(state): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    let replication = state.replication.clone();
    let primary = blocking(move || Ok(replication.scrub_target(&name)?)).await?;
    let job = state.jobs.start("volume scrub", move |progress| {
        let report = primary.scrub(&mut |done, total| progress.report(done, total), &|| false)?;
        Ok(serde_json::to_value(report)?)
    });
    Ok(Json(serde_json::json!({ "job": job })))
}

async fn delete_volume(
    State(state): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    // Validate now so a missing volume is a 404, then delete as a job (it can be large).
    if !state.volumes.list().iter().any(|v| v.name == name) {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("volume {name:?} not found"),
        ));
    }
    let volumes = state.volumes.clone();
    let job = state.jobs.start("volume delete", move |progress| {
        volumes.delete(&name, &mut |p| progress.report(p.done, p.total))?;
        Ok(serde_json::json!({ "deleted": name }))
    });
    Ok(Json(serde_json::json!({ "job": job })))
}

#[derive(Deserialize)]
pub struct SnapshotListQuery {
    /// Count each snapshot's space use: a scan of the volume's block keys on its primary, which
    /// grows with the volume. `false` answers from the catalog at once (the CSI driver).
    #[serde(default = "default_true")]
    pub usage: bool,
}

async fn list_snapshots(
    State(state): State<Shared>,
    Path(name): Path<String>,
    Query(query): Query<SnapshotListQuery>,
) -> ApiResult<Json<Vec<SnapshotJson>>> {
    blocking(move || {
        Ok(Json(
            state
                .volumes
                .snapshot_list(&name, query.usage)?
                .iter()
                .map(snapshot_json)
                .collect(),
        ))
    })
    .await
}

#[derive(Deserialize)]
pub struct NameRequest {
    pub name: String,
}

async fn create_snapshot(
    State(state): State<Shared>,
    Path(name): Path<String>,
    Json(request): Json<NameRequest>,
) -> ApiResult<Json<SnapshotJson>> {
    blocking(move || {
        Ok(Json(snapshot_json(
            &state.replication.quiesce(&name, || {
                state.volumes.snapshot_create(&name, &request.name)
            })?,
        )))
    })
    .await
}

async fn delete_snapshot(
    State(state): State<Shared>,
    Path((name, snapshot)): Path<(String, String)>,
) -> ApiResult<Json<serde_json::Value>> {
    blocking(move || {
        state
            .volumes
            .snapshot_delete(&name, &snapshot, &mut |_| {})?;
        Ok(Json(
            serde_json::json!({ "deleted": format!("{name}@{snapshot}") }),
        ))
    })
    .await
}

async fn rollback_snapshot(
    State(state): State<Shared>,
    Path((name, snapshot)): Path<(String, String)>,
) -> ApiResult<Json<serde_json::Value>> {
    blocking(move || {
        state.replication.rollback(&name, &snapshot, || {
            state.volumes.rollback(&name, &snapshot)
        })?;
        Ok(Json(
            serde_json::json!({ "rolled_back": format!("{name}@{snapshot}") }),
        ))
    })
    .await
}

async fn clone_snapshot(
    State(state): State<Shared>,
    Path((name, snapshot)): Path<(String, String)>,
    Json(request): Json<NameRequest>,
) -> ApiResult<Json<VolumeJson>> {
    blocking(move || {
        Ok(Json(volume_json(&state.volumes.clone_volume(
            &name,
            &snapshot,
            &request.name,
        )?)))
    })
    .await
}

#[derive(Deserialize)]
pub struct SendQuery {
    pub snapshot: String,
    pub base: Option<String>,
}

/// Streams a send stream: a blocking thread reads it in 1 MiB chunks into a bounded channel.
async fn send_volume(
    State(state): State<Shared>,
    Path(name): Path<String>,
    Query(query): Query<SendQuery>,
) -> ApiResult<Response> {
    let volumes = state.volumes.clone();
    let mut stream =
        blocking(move || Ok(volumes.send(&name, query.base.as_deref(), &query.snapshot)?)).await?;
    let (sender, receiver) =
        tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(STREAM_CHANNEL_CHUNKS_MAX);
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        loop {
            let mut chunk = vec![0u8; STREAM_CHUNK_BYTES];
            match stream.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => {
                    chunk.truncate(n);
                    if sender.blocking_send(Ok(chunk)).is_err() {
                        break;
                    }
                }
                Err(error) => {
                    let _ = sender.blocking_send(Err(error));
                    break;
                }
            }
        }
    });
    let body = Body::from_stream(tokio_stream_from(receiver));
    Ok((
        [(header::CONTENT_TYPE, "application/x-keel-send-stream")],
        body,
    )
        .into_response())
}

fn tokio_stream_from(
    mut receiver: tokio::sync::mpsc::Receiver<Result<Vec<u8>, std::io::Error>>,
) -> impl futures::Stream<Item = Result<Vec<u8>, std::io::Error>> {
    futures::stream::poll_fn(move |cx| receiver.poll_recv(cx))
}

/// Applies a stream from the request body; the body is fed to a blocking reader through a
/// bounded channel, so memory stays bounded whatever the stream's size.
async fn receive_volume(
    State(state): State<Shared>,
    Path(name): Path<String>,
    request: Request,
) -> ApiResult<Json<serde_json::Value>> {
    use futures::StreamExt;
    if let Err(refusal) = state.replication.check_receive_here(&name) {
        // Read (and drop) the body first: the client sends all of it before reading the
        // answer, and would see a broken pipe instead.
        let mut body = request.into_body().into_data_stream();
        while let Some(Ok(_)) = body.next().await {}
        return Err(refusal.into());
    }
    let (sender, receiver) = tokio::sync::mpsc::channel::<bytes::Bytes>(STREAM_CHANNEL_CHUNKS_MAX);
    let volumes = state.volumes.clone();
    let replication = state.replication.clone();
    let applying = tokio::task::spawn_blocking(move || {
        let mut reader = ChannelReader {
            receiver,
            current: bytes::Bytes::new(),
        };
        volumes.receive_published_by(&mut reader, &name, &|publish| {
            replication.publish_received(&name, publish)
        })
    });
    let mut body = request.into_body().into_data_stream();
    let mut forwarding = true;
    while let Some(chunk) = body.next().await {
        let Ok(chunk) = chunk else {
            // The client went away: the receiver sees the stream end early and refuses it.
            break;
        };
        if !forwarding {
            // The stream was refused already; read (and drop) the rest so the client, which
            // sends the whole body before reading, gets the answer instead of a broken pipe.
            continue;
        }
        forwarding = sender.send(chunk).await.is_ok();
    }
    drop(sender);
    let report = applying.await.map_err(internal)??;
    Ok(Json(
        serde_json::json!({ "received": format!("{report:?}") }),
    ))
}

/// The request body as a blocking `Read` for the receiving thread; memory stays bounded by the
/// channel's capacity.
struct ChannelReader {
    receiver: tokio::sync::mpsc::Receiver<bytes::Bytes>,
    current: bytes::Bytes,
}

impl std::io::Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            match self.receiver.blocking_recv() {
                Some(chunk) => self.current = chunk,
                // The body ended (or the client went away): the stream's own framing says
                // whether it was complete.
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

// ---------------------------------------------------------------------------------------------
// Buckets and keys.

#[derive(Deserialize)]
pub struct CreateBucket {
    pub name: String,
    /// Access key that will own the bucket (defaults to the first key).
    pub owner: Option<String>,
    pub compression: Option<String>,
}

async fn list_buckets(State(state): State<Shared>) -> Json<serde_json::Value> {
    let buckets: Vec<serde_json::Value> = state
        .s3
        .list_buckets()
        .iter()
        .map(|b| {
            let compression = Compression::from_code(b.compression_code).unwrap_or_default();
            serde_json::json!({ "name": b.name, "owner": b.owner, "compression": compression.name() })
        })
        .collect();
    Json(serde_json::Value::Array(buckets))
}

async fn create_bucket(
    State(state): State<Shared>,
    Json(request): Json<CreateBucket>,
) -> ApiResult<Json<serde_json::Value>> {
    if let Some(name) = request.compression.as_deref() {
        parse_compression(Some(name))?;
    }
    blocking(move || {
        let owner = match request.owner {
            Some(owner) => owner,
            None => state
                .s3
                .list_keys()
                .first()
                .map(|k| k.access_key_id.clone())
                .ok_or_else(|| {
                    bad_request("no access key exists yet: create one with `keel key create`")
                })?,
        };
        state
            .s3
            .create_bucket(&request.name, &owner, request.compression.as_deref())?;
        Ok(Json(
            serde_json::json!({ "name": request.name, "owner": owner }),
        ))
    })
    .await
}

async fn bucket_info(
    State(state): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    blocking(move || {
        let info = state.s3.bucket_info(&name)?;
        Ok(Json(serde_json::json!({
            "name": name,
            "objects": info.objects,
            "owner": info.owner,
            "grants": info.grants,
            "compression": info.compression,
            "bytes": info.logical_bytes,
            "unique_bytes": info.unique_bytes,
            "stored_bytes_estimate": info.stored_bytes_estimate,
            "compression_ratio": info.compression_ratio,
            "uploads_in_progress": info.uploads_in_progress,
            "versioning": info.versioning,
            "kept_versions": info.kept_versions,
            "object_lock": info.object_lock,
            "policy": info.has_policy,
        })))
    })
    .await
}

async fn delete_bucket(
    State(state): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    blocking(move || {
        state.s3.delete_bucket(&name)?;
        Ok(Json(serde_json::json!({ "deleted": name })))
    })
    .await
}

#[derive(Deserialize)]
pub struct AllowRequest {
    pub access_key_id: String,
}

async fn allow_bucket(
    State(state): State<Shared>,
    Path(name): Path<String>,
    Json(request): Json<AllowRequest>,
) -> ApiResult<Json<serde_json::Value>> {
    blocking(move || {
        state.s3.allow(&name, &request.access_key_id)?;
        Ok(Json(
            serde_json::json!({ "bucket": name, "allowed": request.access_key_id }),
        ))
    })
    .await
}

async fn list_keys(State(state): State<Shared>) -> Json<serde_json::Value> {
    let keys: Vec<serde_json::Value> = state
        .s3
        .list_keys()
        .iter()
        .map(|k| serde_json::json!({ "access_key_id": k.access_key_id, "name": k.name }))
        .collect();
    Json(serde_json::Value::Array(keys))
}

async fn create_key(
    State(state): State<Shared>,
    Json(request): Json<NameRequest>,
) -> ApiResult<Json<serde_json::Value>> {
    blocking(move || {
        let (id, secret) = state.s3.create_key(&request.name)?;
        Ok(Json(serde_json::json!({ "name": request.name, "access_key_id": id, "secret_access_key": secret })))
    })
    .await
}

async fn delete_key(
    State(state): State<Shared>,
    Path(id): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    blocking(move || {
        state.s3.delete_key(&id)?;
        Ok(Json(serde_json::json!({ "deleted": id })))
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Store maintenance and jobs.

async fn start_scrub(State(state): State<Shared>) -> Json<serde_json::Value> {
    let store = state.store.clone();
    let job = state.jobs.start("scrub", move |progress| {
        let report = store.scrub(&mut |p| progress.report(p.done, p.total))?;
        Ok(serde_json::json!({
            "extents_checked": report.extents_checked,
            "bytes_checked": report.bytes_checked,
            "repaired_copies": report.repaired_copies,
            "unrecoverable_extents": report.unrecoverable_extents,
            "unrecoverable_keys": report.unrecoverable_keys,
        }))
    });
    Json(serde_json::json!({ "job": job }))
}

#[derive(Deserialize)]
pub struct CompactRequest {
    pub dead_ratio_min: Option<f64>,
}

async fn start_compact(
    State(state): State<Shared>,
    Json(request): Json<CompactRequest>,
) -> ApiResult<Json<serde_json::Value>> {
    let ratio = request.dead_ratio_min.unwrap_or(0.5);
    if !(0.0..=1.0).contains(&ratio) {
        return Err(bad_request("dead_ratio_min must be between 0 and 1"));
    }
    let store = state.store.clone();
    let volumes = state.volumes.clone();
    let s3 = state.s3.clone();
    let job = state.jobs.start("compact", move |progress| {
        // Garbage first (unreferenced chunks and blocks), then reclaim the segments.
        let mut volume_extents_deleted = 0;
        for volume in volumes.list() {
            volume_extents_deleted += volumes
                .collect_garbage(&volume.name, &mut |_| {})?
                .extents_deleted;
        }
        let object_gc = s3.collect_garbage()?;
        let report = store.compact(ratio, &mut |p| progress.report(p.done, p.total))?;
        Ok(serde_json::json!({
            "volume_extents_deleted": volume_extents_deleted,
            "object_gc": format!("{object_gc:?}"),
            "segments_compacted": report.segments_compacted,
            "extents_moved": report.extents_moved,
            "bytes_reclaimed": report.bytes_reclaimed,
        }))
    });
    Ok(Json(serde_json::json!({ "job": job })))
}

async fn list_ops(State(state): State<Shared>) -> Json<keel_ops::OpsReport> {
    Json(state.ops.report())
}

#[derive(Deserialize)]
pub struct RefusalsQuery {
    export: Option<String>,
    after: Option<u64>,
}

async fn list_refusals(
    State(state): State<Shared>,
    Query(query): Query<RefusalsQuery>,
) -> Json<crate::refusals::Listing> {
    Json(state.refusals.list(query.export.as_deref(), query.after))
}

async fn list_jobs(State(state): State<Shared>) -> Json<Vec<crate::jobs::JobStatus>> {
    Json(state.jobs.list())
}

async fn job_status(
    State(state): State<Shared>,
    Path(id): Path<u64>,
) -> ApiResult<Json<crate::jobs::JobStatus>> {
    state
        .jobs
        .get(id)
        .map(Json)
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("no job {id}")))
}

// ---------------------------------------------------------------------------------------------
// Cluster and nodes.

fn metadata_error(error: keel_catalog::MetadataError) -> ApiError {
    use keel_catalog::{CatalogError, MetadataError};
    let status = match &error {
        MetadataError::Refused(CatalogError::NodeNotFound { .. }) => StatusCode::NOT_FOUND,
        MetadataError::Refused(CatalogError::NodeInUse { .. }) => StatusCode::CONFLICT,
        MetadataError::Refused(_) => StatusCode::BAD_REQUEST,
        MetadataError::Unavailable { .. } | MetadataError::Timeout { .. } => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        MetadataError::Failed { .. } => StatusCode::INTERNAL_SERVER_ERROR,
    };
    ApiError(status, error.to_string())
}

async fn cluster_status(State(state): State<Shared>) -> Json<keel_cluster::ClusterStatus> {
    Json(state.cluster.status().await)
}

async fn cluster_token(State(state): State<Shared>) -> ApiResult<Json<serde_json::Value>> {
    let path = state.config.token_path();
    let token = std::fs::read_to_string(&path)
        .map_err(|error| internal(format!("reading {}: {error}", path.display())))?;
    Ok(Json(serde_json::json!({ "token": token.trim() })))
}

#[derive(Deserialize, Default)]
struct LifecycleRequest {
    /// Apply the rules as of this moment instead of now (tests; only with `--debug-faults`,
    /// as it expires objects early).
    as_of_unix_ms: Option<i64>,
}

/// One pass of every bucket's S3 lifecycle rules, now; answers what it expired and aborted.
async fn run_lifecycle(
    State(state): State<Shared>,
    request: Option<Json<LifecycleRequest>>,
) -> ApiResult<Json<serde_json::Value>> {
    let request = request.map(|Json(request)| request).unwrap_or_default();
    let now = match request.as_of_unix_ms {
        Some(_) if !state.config.cluster.debug_faults => {
            return Err(ApiError(
                StatusCode::BAD_REQUEST,
                "as_of_unix_ms is for tests: start the server with --debug-faults".to_string(),
            ))
        }
        Some(as_of) => as_of,
        None => keel_clock::Clock::wall_unix_ms(&keel_clock::SystemClock),
    };
    let (objects, stats) = (state.s3.objects().clone(), state.lifecycle.clone());
    let report =
        tokio::task::spawn_blocking(move || stats.pass(&objects, now, &keel_clock::SystemClock))
            .await
            .map_err(|error| internal(error.to_string()))?
            .map_err(|error| internal(error.to_string()))?;
    Ok(Json(serde_json::json!({
        "as_of_unix_ms": now,
        "objects_expired": report.objects_expired,
        "versions_expired": report.versions_expired,
        "delete_markers_removed": report.delete_markers_removed,
        "uploads_aborted": report.uploads_aborted,
    })))
}

#[derive(Deserialize)]
struct LeaderRequest {
    /// The node to lead: a name or an id.
    node: String,
}

/// Hands Raft leadership to a voter; answers once this node sees it lead.
async fn transfer_leadership(
    State(state): State<Shared>,
    Json(request): Json<LeaderRequest>,
) -> ApiResult<Json<serde_json::Value>> {
    let record = find_node(&state, &request.node)?;
    state
        .cluster
        .transfer_leadership(record.id)
        .await
        .map_err(metadata_error)?;
    Ok(Json(
        serde_json::json!({ "leader": record.id, "name": record.name }),
    ))
}

async fn list_nodes(State(state): State<Shared>) -> Json<Vec<keel_cluster::NodeStatus>> {
    Json(state.cluster.status().await.nodes)
}

/// A node by name or by id.
fn find_node(state: &AppState, name: &str) -> ApiResult<keel_catalog::NodeRecord> {
    let catalog = state.cluster.catalog().read();
    let found = catalog
        .node_by_name(name)
        .or_else(|| {
            name.parse::<u64>()
                .ok()
                .and_then(|id| catalog.nodes.get(&id))
        })
        .cloned();
    found.ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("node {name:?} not found")))
}

/// A node as the cluster sees it, and the volume replicas it holds.
#[derive(Serialize)]
struct NodeInfo {
    #[serde(flatten)]
    status: keel_cluster::NodeStatus,
    replicas: Vec<NodeReplica>,
}

/// One volume replica on a node.
#[derive(Serialize)]
struct NodeReplica {
    volume: String,
    primary: bool,
    in_sync: bool,
    /// Snapshots only this node holds whole, when its replica would move (the node is down
    /// for the move time, draining or removed) but stays for them: what a stalled drain
    /// waits for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    held_for: Vec<String>,
}

async fn node_info(
    State(state): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<NodeInfo>> {
    let record = find_node(&state, &name)?;
    let status = state.cluster.status().await;
    let status = status
        .nodes
        .into_iter()
        .find(|node| node.record.id == record.id)
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("node {name:?} not found")))?;
    let mut held = state.replication.held_replicas();
    held.retain(|held| held.node == record.id);
    let catalog = state.cluster.catalog().read();
    let mut replicas: Vec<NodeReplica> = catalog
        .volumes
        .values()
        .map(|entry| &entry.record)
        .filter(|volume| volume.replication.replicas.contains(&record.id))
        .map(|volume| NodeReplica {
            volume: volume.name.clone(),
            primary: volume.replication.primary == record.id,
            in_sync: volume.replication.in_sync.contains(&record.id),
            held_for: held
                .iter()
                .find(|held| held.volume == volume.name)
                .map(|held| held.snapshots.clone())
                .unwrap_or_default(),
        })
        .collect();
    drop(catalog);
    replicas.sort_by(|a, b| a.volume.cmp(&b.volume));
    Ok(Json(NodeInfo { status, replicas }))
}

#[derive(Deserialize)]
struct DrainRequest {
    /// false: stop draining.
    #[serde(default = "default_true")]
    draining: bool,
}

fn default_true() -> bool {
    true
}

async fn drain_node(
    State(state): State<Shared>,
    Path(name): Path<String>,
    Json(request): Json<DrainRequest>,
) -> ApiResult<Json<serde_json::Value>> {
    let record = find_node(&state, &name)?;
    state
        .cluster
        .drain(record.id, request.draining)
        .await
        .map_err(metadata_error)?;
    let left = DrainLeft::of(&state.cluster.catalog().read(), record.id);
    Ok(Json(serde_json::json!({
        "node": record.name,
        "draining": request.draining,
        "replicas": left.replicas,
        "primaries": left.primaries,
        "single_copies": left.single_copies,
        "waiting": (left.waiting.iter())
            .map(|(volume, waits)| serde_json::json!({
                "volume": volume,
                "why": describe_waits(waits),
            }))
            .collect::<Vec<_>>(),
    })))
}

async fn remove_node(
    State(state): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    let record = find_node(&state, &name)?;
    state
        .cluster
        .remove(record.id)
        .await
        .map_err(metadata_error)?;
    Ok(Json(
        serde_json::json!({ "removed": record.name, "id": record.id }),
    ))
}

#[derive(Deserialize)]
struct FaultRequest {
    /// Node ids whose traffic with this node is dropped (both directions); empty: heal.
    #[serde(default)]
    blocked_nodes: Vec<u64>,
    /// Calls this node makes that wait before they are sent; empty: none.
    #[serde(default)]
    delays: Vec<DelayRequest>,
}

#[derive(Deserialize, Serialize)]
struct DelayRequest {
    /// The node called.
    node: u64,
    /// Only calls of this transport method (all when absent).
    #[serde(default)]
    method: Option<u16>,
    milliseconds: u64,
    /// Each call waits a random time up to `milliseconds` instead (calls sent together then
    /// arrive out of order).
    #[serde(default)]
    jitter: bool,
}

async fn set_faults(
    State(state): State<Shared>,
    Json(request): Json<FaultRequest>,
) -> ApiResult<Json<serde_json::Value>> {
    let Some(faults) = &state.faults else {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            "fault injection is off (start the server with --debug-faults)".to_string(),
        ));
    };
    let delays: Vec<keel_rpc::Delay> = request
        .delays
        .iter()
        .map(|delay| keel_rpc::Delay {
            node: delay.node,
            method: delay.method,
            by: Duration::from_millis(delay.milliseconds),
            jitter: delay.jitter,
        })
        .collect();
    faults.set(&request.blocked_nodes, &delays);
    tracing::warn!(blocked = ?request.blocked_nodes, ?delays, "debug fault injection changed");
    Ok(Json(
        serde_json::json!({ "blocked_nodes": request.blocked_nodes, "delays": request.delays }),
    ))
}
