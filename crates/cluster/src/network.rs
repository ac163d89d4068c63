//! openraft's network (`RaftNetworkV2`) over the cluster transport: each Raft RPC is one
//! transport call carrying the postcard-encoded openraft message, answered by the target's
//! [`crate::Cluster`] handler, which hands it to its `Raft`.
//!
//! Every call is bounded by openraft's `soft_ttl`; "never sent" maps to `Unreachable` (openraft
//! backs off), a timeout to `Timeout`, anything else to `Network` (retried soon).
//!
//! A vote's answer also says how long ago the voter last heard from any leader; the candidate
//! keeps that of every vote granted to it ([`Grants`]), so once it leads it knows since when no
//! earlier leader can have had a quorum (see [`crate::Cluster::silent_for`]).

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keel_catalog::NodeId;
use openraft::errors::{
    NetworkError, RPCError, RaftError, ReplicationClosed, StreamingError, Timeout, Unreachable,
};
use openraft::network::{RPCOption, RPCTypes, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, TransferLeaderRequest,
    TransferLeaderResponse, VoteRequest, VoteResponse,
};
use openraft::{OptionalSend, RaftNetworkV2};

use crate::log_store::{decode, encode};
use crate::messages::{
    METHOD_RAFT_APPEND, METHOD_RAFT_PRE_VOTE, METHOD_RAFT_SNAPSHOT, METHOD_RAFT_TRANSFER_LEADER,
    METHOD_RAFT_VOTE,
};
use crate::transport::{Peer, Transport, TransportError};
use crate::types::{RaftNode, Snapshot, SnapshotMeta, TypeConfig, Vote};

/// The votes granted to this node, most recent last, each with the latest instant (on this
/// node's clock) at which its voter can have acknowledged a leader before it voted.
#[derive(Default)]
pub(crate) struct Grants {
    granted: VecDeque<(Vote, Instant)>,
}

/// Enough for the grants of the last few elections of any cluster size Keel runs.
const GRANTS_KEPT: usize = 64;

impl Grants {
    fn record(&mut self, vote: Vote, heard_leader_at: Instant) {
        if self.granted.len() == GRANTS_KEPT {
            self.granted.pop_front();
        }
        self.granted.push_back((vote, heard_leader_at));
    }

    /// The latest instant at which a voter that granted `vote` had heard a leader, if any
    /// voter granted it. Every voter of the quorum that elected `vote` is among them: their
    /// answers reach openraft only through [`NetworkClient::vote`].
    pub(crate) fn heard_leader_by_voters_of(&self, vote: &Vote) -> Option<Instant> {
        self.granted
            .iter()
            .filter(|(granted, _)| granted.leader_id == vote.leader_id)
            .map(|(_, heard)| *heard)
            .max()
    }
}

/// A vote's answer: openraft's response and how long ago (ms) the voter last heard from a
/// leader (since it started, if never).
pub(crate) type VoteAnswer = (VoteResponse<TypeConfig>, u64);

/// Makes a network client per target node.
pub struct NetworkFactory {
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) local_node: NodeId,
    pub(crate) clock: Arc<dyn keel_clock::Clock>,
    pub(crate) grants: Arc<Mutex<Grants>>,
}

impl RaftNetworkFactory<TypeConfig> for NetworkFactory {
    type Network = NetworkClient;

    async fn new_client(&mut self, target: NodeId, node: &RaftNode) -> NetworkClient {
        NetworkClient {
            transport: self.transport.clone(),
            local_node: self.local_node,
            target,
            address: node.address.clone(),
            clock: self.clock.clone(),
            grants: self.grants.clone(),
        }
    }
}

pub struct NetworkClient {
    transport: Arc<dyn Transport>,
    local_node: NodeId,
    target: NodeId,
    address: String,
    clock: Arc<dyn keel_clock::Clock>,
    grants: Arc<Mutex<Grants>>,
}

impl NetworkClient {
    async fn call<Request, Response>(
        &self,
        action: RPCTypes,
        method: u16,
        request: &Request,
        ttl: Duration,
    ) -> Result<Response, RPCError<TypeConfig>>
    where
        Request: serde::Serialize,
        Response: for<'de> serde::Deserialize<'de>,
    {
        let payload = encode(request).map_err(|error| NetworkError::new(&error))?;
        let peer = Peer::Node {
            id: self.target,
            address: self.address.clone(),
        };
        match self.transport.call(peer, method, payload.into(), ttl).await {
            Ok(bytes) => {
                let answer: Result<Response, RaftError<TypeConfig>> =
                    decode("a raft answer", &bytes).map_err(|error| NetworkError::new(&error))?;
                answer.map_err(|error| RPCError::Unreachable(Unreachable::new(&error)))
            }
            Err(error @ (TransportError::Unreachable { .. } | TransportError::Refused { .. })) => {
                Err(RPCError::Unreachable(Unreachable::new(&error)))
            }
            Err(TransportError::Timeout { .. }) => Err(RPCError::Timeout(Timeout {
                action,
                id: self.local_node,
                target: self.target,
                timeout: ttl,
            })),
            Err(error @ TransportError::Remote { .. }) => {
                // The target is up but not ready for Raft (still joining, shutting down): back off.
                Err(RPCError::Unreachable(Unreachable::new(&error)))
            }
            Err(error) => Err(RPCError::Network(NetworkError::new(&error))),
        }
    }
}

fn streaming(error: RPCError<TypeConfig>) -> StreamingError<TypeConfig> {
    match error {
        RPCError::Timeout(timeout) => StreamingError::Timeout(timeout),
        RPCError::Unreachable(unreachable) => StreamingError::Unreachable(unreachable),
        RPCError::Network(network) => StreamingError::Network(network),
        RPCError::RemoteError(remote) => {
            StreamingError::Network(NetworkError::from_string(remote.to_string()))
        }
    }
}

impl RaftNetworkV2<TypeConfig> for NetworkClient {
    type SnapshotData = Vec<u8>;

    async fn append_entries(
        &mut self,
        request: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(
            RPCTypes::AppendEntries,
            METHOD_RAFT_APPEND,
            &request,
            option.soft_ttl(),
        )
        .await
    }

    async fn vote(
        &mut self,
        request: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        let (response, heard_ms_ago): VoteAnswer = self
            .call(
                RPCTypes::Vote,
                METHOD_RAFT_VOTE,
                &request,
                option.soft_ttl(),
            )
            .await?;
        if response.vote_granted {
            // The voter heard its last leader `heard_ms_ago` before it answered, so no later
            // than that before this answer arrived. (An instant this clock cannot represent
            // becomes now: later only makes a take-over wait longer.)
            let now = self.clock.now();
            let heard = now
                .checked_sub(Duration::from_millis(heard_ms_ago))
                .unwrap_or(now);
            crate::lock(&self.grants).record(request.vote, heard);
        }
        Ok(response)
    }

    /// Asks whether the target would grant a vote (nothing changes there): a node cut off and
    /// coming back does not disrupt a leader the others still follow.
    async fn pre_vote(
        &mut self,
        request: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(
            RPCTypes::Vote,
            METHOD_RAFT_PRE_VOTE,
            &request,
            option.soft_ttl(),
        )
        .await
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot,
        cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let request: (Vote, SnapshotMeta, Vec<u8>) = (vote, snapshot.meta, snapshot.snapshot);
        let send = self.call(
            RPCTypes::InstallSnapshot,
            METHOD_RAFT_SNAPSHOT,
            &request,
            option.hard_ttl(),
        );
        tokio::select! {
            biased;
            closed = cancel => Err(StreamingError::Closed(closed)),
            answer = send => answer.map_err(streaming),
        }
    }

    async fn transfer_leader(
        &mut self,
        request: TransferLeaderRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<TransferLeaderResponse<TypeConfig>, RPCError<TypeConfig>> {
        self.call(
            RPCTypes::TransferLeader,
            METHOD_RAFT_TRANSFER_LEADER,
            &request,
            option.soft_ttl(),
        )
        .await
    }
}
