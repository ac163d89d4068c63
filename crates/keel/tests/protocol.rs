//! Every message nodes exchange, as a recorded format: the shape of each type (fields, their
//! types, enum variants, in order) as serde sees it, traced with serde-reflection. A change to
//! any of them changes how postcard encodes it, so a node of the old build would misread it;
//! such a change must come with a new `keel_rpc::handshake::PROTOCOL`, which makes nodes of
//! different builds refuse each other at the handshake instead. This test fails until it does.
//!
//! After a deliberate change: bump `PROTOCOL`, then `KEEL_UPDATE_PROTOCOL=1 cargo test -p keel
//! --test protocol` rewrites `tests/protocol.json`. The Raft log and snapshots on disk hold the
//! same catalog commands: see `docs/on-disk-format.md` before changing those.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use keel_cluster::{messages, TypeConfig};
use keel_replication::wire;
use serde_reflection::{Registry, Tracer, TracerConfig};

type Vote = openraft::alias::VoteOf<TypeConfig>;
type SnapshotMeta = openraft::alias::SnapshotMetaOf<TypeConfig>;

/// The formats of every request and answer, by method (`crates/cluster/src/messages.rs`,
/// `crates/replication/src/wire.rs`), and the enums they hold (traced on their own so that
/// every variant is seen).
fn registry() -> Registry {
    let mut tracer = Tracer::new(TracerConfig::default());
    macro_rules! trace {
        ($($kind:ty),* $(,)?) => {
            $(tracer.trace_simple_type::<$kind>().unwrap();)*
        };
    }
    trace!(
        // Enums nested in the messages below.
        keel_catalog::Command,
        keel_catalog::Outcome,
        keel_catalog::CatalogError,
        keel_catalog::NodeRole,
        keel_catalog::NodeState,
        keel_catalog::VolumeStatus,
        keel_catalog::LockMode,
        Result<keel_catalog::Outcome, keel_catalog::CatalogError>,
        openraft::EntryPayload<messages::Proposal, u64, keel_cluster::RaftNode>,
        wire::Op,
        wire::ForwardErrorKind,
        wire::ForwardOp,
        wire::TurnAction,
        openraft::ErrorSubject<TypeConfig>,
        openraft::ErrorVerb,
        // Raft.
        openraft::raft::AppendEntriesRequest<TypeConfig>,
        openraft::raft::AppendEntriesResponse<TypeConfig>,
        openraft::raft::VoteRequest<TypeConfig>,
        (openraft::raft::VoteResponse<TypeConfig>, u64),
        (Vote, SnapshotMeta, Vec<u8>),
        openraft::raft::SnapshotResponse<TypeConfig>,
        openraft::raft::TransferLeaderRequest<TypeConfig>,
        // Raft's answers are `Result<_, RaftError<_>>`, whose API error is `Infallible` (not
        // traceable); its other variant:
        openraft::error::Fatal<TypeConfig>,
        // The cluster's own calls.
        messages::JoinRequest,
        messages::JoinResponse,
        messages::Proposal,
        messages::Proposed,
        messages::NodeReport,
        Option<u64>,
        Vec<keel_cluster::NodeLiveness>,
        // Replication and forwarding.
        wire::Batch,
        wire::BatchAck,
        wire::HashRequest,
        wire::HashAnswer,
        wire::UnwrittenAnswer,
        wire::CopyAnswer,
        wire::ChangedRequest,
        wire::ChangedAnswer,
        wire::CopyTurnRequest,
        wire::CopyTurnAnswer,
        wire::HandOverRequest,
        wire::HandOverAnswer,
        wire::HandedOff,
        wire::PrimaryStatusRequest,
        wire::PrimaryStatusAnswer,
        wire::SnapshotRange,
        wire::SnapshotRepairWrite,
        wire::ForwardOpen,
        wire::ForwardOpened,
        wire::ForwardRequest,
        wire::ForwardAnswer,
        wire::ForwardClose,
    );
    tracer
        .registry()
        .expect("every enum the messages hold is traced above (add the one named)")
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Recorded {
    protocol: u16,
    formats: Registry,
}

#[test]
fn a_changed_message_comes_with_a_new_protocol() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/protocol.json");
    let current = Recorded {
        protocol: keel_rpc::handshake::PROTOCOL,
        formats: registry(),
    };
    if std::env::var_os("KEEL_UPDATE_PROTOCOL").is_some() {
        let text = serde_json::to_string_pretty(&current).unwrap();
        std::fs::write(&path, text + "\n").unwrap();
        return;
    }
    let recorded: Recorded =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    if recorded.formats != current.formats {
        assert_ne!(
            recorded.protocol, current.protocol,
            "a node-to-node message changed: bump keel_rpc::handshake::PROTOCOL (nodes of \
             different builds must refuse each other), then record the new formats with \
             KEEL_UPDATE_PROTOCOL=1 cargo test -p keel --test protocol"
        );
        panic!(
            "protocol {} has new formats: record them with KEEL_UPDATE_PROTOCOL=1 cargo test \
             -p keel --test protocol",
            current.protocol
        );
    }
    assert_eq!(
        recorded.protocol, current.protocol,
        "PROTOCOL changed with no message change: record it with KEEL_UPDATE_PROTOCOL=1"
    );
}
