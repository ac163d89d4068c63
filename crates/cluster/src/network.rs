//! openraft's network (`RaftNetworkV2`) over the cluster transport: each Raft RPC is one
//! transport call carrying the postcard-encoded openraft message, answered by the target's
//! [`crate::Cluster`] handler, which hands it to its `Raft`.
//!
//! Every call is bounded by openraft's `soft_ttl`; "never sent" maps to `Unreachable` (openraft
//! backs off), a timeout to `Timeout`, anything else to `Network` (retried soon).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

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
    METHOD_RAFT_APPEND, METHOD_RAFT_SNAPSHOT, METHOD_RAFT_TRANSFER_LEADER, METHOD_RAFT_VOTE,
};
use crate::transport::{Peer, Transport, TransportError};
use crate::types::{RaftNode, Snapshot, SnapshotMeta, TypeConfig, Vote};

/// Makes a network client per target node.
pub struct NetworkFactory {
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) local_node: NodeId,
}

impl RaftNetworkFactory<TypeConfig> for NetworkFactory {
    type Network = NetworkClient;

    async fn new_client(&mut self, target: NodeId, node: &RaftNode) -> NetworkClient {
        NetworkClient {
            transport: self.transport.clone(),
            local_node: self.local_node,
            target,
            address: node.address.clone(),
        }
    }
}

pub struct NetworkClient {
    transport: Arc<dyn Transport>,
    local_node: NodeId,
    target: NodeId,
    address: String,
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
        match self.transport.call(peer, method, payload, ttl).await {
            Ok(bytes) => {
                let answer: Result<Response, RaftError<TypeConfig>> =
                    decode("a raft answer", &bytes).map_err(|error| NetworkError::new(&error))?;
                answer.map_err(|error| RPCError::Unreachable(Unreachable::new(&error)))
            }
            Err(error @ TransportError::Unreachable { .. }) => {
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
        self.call(
            RPCTypes::Vote,
            METHOD_RAFT_VOTE,
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
