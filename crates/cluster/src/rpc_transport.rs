//! The cluster's transport over `keel-rpc` (TCP, authenticated): the client side as a
//! [`Transport`], the server side as a `keel_rpc::Handler` that hands calls to a [`Handler`].

use std::sync::Arc;
use std::time::Duration;

use crate::transport::{BoxFuture, Caller, Handler, Peer, Transport, TransportError};

/// Calls other nodes through `keel_rpc::Peers`.
pub struct RpcTransport {
    peers: Arc<keel_rpc::Peers>,
}

impl RpcTransport {
    pub fn new(peers: Arc<keel_rpc::Peers>) -> RpcTransport {
        RpcTransport { peers }
    }
}

fn transport_error(error: keel_rpc::RpcError) -> TransportError {
    use keel_rpc::RpcError as E;
    match error {
        E::Timeout { peer, timeout } => TransportError::Timeout { peer, timeout },
        E::ConnectionLost { peer, detail } => TransportError::Lost { peer, detail },
        E::Remote { peer, error } => TransportError::Remote {
            peer,
            code: error.code,
            message: error.message,
        },
        E::Unreachable { peer, detail } => TransportError::Unreachable { peer, detail },
        E::Auth { peer, detail } => TransportError::Refused { peer, detail },
        error @ (E::WrongPeer { .. } | E::FrameTooLarge { .. }) => TransportError::Unreachable {
            peer: String::new(),
            detail: error.to_string(),
        },
    }
}

impl Transport for RpcTransport {
    fn call(
        &self,
        peer: Peer,
        method: u16,
        payload: crate::Payload,
        timeout: Duration,
    ) -> BoxFuture<Result<Vec<u8>, TransportError>> {
        let peers = self.peers.clone();
        let target = match peer {
            Peer::Node { id, address } => keel_rpc::Target::Node { id, address },
            Peer::AnyAt { address } => keel_rpc::Target::AnyAt { address },
        };
        Box::pin(async move {
            peers
                .call(target, method, payload, timeout)
                .await
                .map_err(transport_error)
        })
    }
}

/// Serves `keel-rpc` calls with a cluster [`Handler`].
pub struct RpcHandler {
    inner: Arc<dyn Handler>,
}

impl RpcHandler {
    pub fn new(inner: Arc<dyn Handler>) -> RpcHandler {
        RpcHandler { inner }
    }
}

impl keel_rpc::Handler for RpcHandler {
    fn call(
        &self,
        caller: keel_rpc::Caller,
        method: u16,
        payload: Vec<u8>,
    ) -> keel_rpc::BoxFuture<Result<Vec<u8>, keel_rpc::RemoteError>> {
        let caller = match caller {
            keel_rpc::Caller::Member(node) => Caller::Member(node),
            keel_rpc::Caller::Unassigned => Caller::Unassigned,
        };
        let answer = self.inner.handle(caller, method, payload);
        Box::pin(async move {
            answer.await.map_err(|failure| keel_rpc::RemoteError {
                code: failure.code,
                message: failure.message,
            })
        })
    }
}
