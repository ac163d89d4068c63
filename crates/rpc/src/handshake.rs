//! Mutual authentication of a new connection from the cluster secret, and the session keys.
//!
//! ```text
//! client → server  hello   "KHLO" version 0 protocol (2)  cluster id (16)  node id (8)  nonce (32)
//! server → client  hello   "KHLO" version status protocol (2)  cluster id (16)  node id (8)  nonce (32)
//!                          proof (32) = keyed BLAKE3(secret; "server", ids, nonces)
//! client → server  proof   "KPRF" proof (32) = keyed BLAKE3(secret; "client", ids, nonces)
//! server → client  verdict "KACC" (accepted) or "KREJ"
//! ```
//!
//! Both sides prove they know the secret over fresh nonces from both sides, so a recorded
//! handshake proves nothing later. The session keys (one per direction) are derived from the
//! secret and both nonces; every frame's MAC uses them. The client sends its proof even when the
//! server's did not verify, so the server can log the refusal too. Node id 0 means "not a member
//! yet" (a joining node). The server refuses another cluster's id with status 1, and a node
//! speaking another [`PROTOCOL`] with status 2 (a build from before protocol numbers sends 0,
//! as those bytes were zero then); the client refuses a server speaking another protocol.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{ClusterSecret, Identity, NodeId};

const HELLO_MAGIC: [u8; 4] = *b"KHLO";
const PROOF_MAGIC: [u8; 4] = *b"KPRF";
const ACCEPT: [u8; 4] = *b"KACC";
const REJECT: [u8; 4] = *b"KREJ";
const HANDSHAKE_VERSION: u8 = 1;
const CLIENT_HELLO_BYTES: usize = 64;
const SERVER_HELLO_BYTES: usize = 96;
const PROOF_BYTES: usize = 36;

const STATUS_OK: u8 = 0;
const STATUS_OTHER_CLUSTER: u8 = 1;
const STATUS_OTHER_PROTOCOL: u8 = 2;

/// The version of everything nodes say to each other: the frames and every message of every
/// layer carried in them (Raft and the catalog's commands, joins, reports, replication,
/// forwarding). Nodes speaking different protocols refuse each other at the handshake, so a
/// message is never decoded by a build that reads it differently. Bump it with any change to
/// a message's encoding (`crates/keel/tests/protocol.rs` fails until it is bumped), and with
/// any change of what the catalog's state machine makes of a command (nodes applying the same
/// log differently would hold different catalogs). 2: a stream received into a replicated
/// volume leaves its snapshot incomplete on the replicas that did not receive it. 3: snapshot
/// repairs (two commands, a snapshot record format, three replication methods). 4: questions
/// about a replica's copy (hashes, unwritten ranges, changes since a point) carry the Raft
/// index the replica must have applied first. 5: replication batches carry the volume's write
/// generation (a replica refuses one queued before a change it has applied). 6: a change of a
/// volume's replicas ends the snapshot repairs of the copies it adds or removes. 7: a command
/// copies a volume's one replica off a draining node (R stays 1 with two replicas). 8: a
/// command records a node as nearly full, and the catalog's snapshot ends with those nodes.
/// 9: the copy off a draining node is made for a replica of any R (R + 1 replicas while R
/// stays), and refused while one is under way. 10: a primary asks a replica's node for a turn
/// to receive a whole copy (a new method and its messages). 11: the leader's answer to a
/// node's report carries the log index it had committed (the node's lease waits until it
/// applied that far). 12: a node where a client attaches asks the volume's primary to hand
/// the volume over (a new method and its messages), and a replica whose store is out of
/// space refuses a batch with a code of its own. 13: any node asks a volume's primary how it
/// serves the volume (a new method and its messages), for `keel status` elsewhere. 14: a
/// primary that handed a volume off tells the new primary so (a new method and its message).
pub const PROTOCOL: u16 = 14;

fn protocol_of(hello: &[u8]) -> u16 {
    u16::from_le_bytes([hello[6], hello[7]])
}

/// The keys of an authenticated connection.
#[derive(Clone)]
pub struct Session {
    pub peer_node: NodeId,
    /// For frames the client sends.
    pub client_to_server: [u8; 32],
    /// For frames the server sends.
    pub server_to_client: [u8; 32],
}

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("I/O during the handshake: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a Keel node-to-node handshake (bad magic or version)")]
    Protocol,
    #[error("it belongs to another cluster ({theirs}, ours {ours})")]
    OtherCluster { ours: String, theirs: String },
    #[error(
        "it speaks node-to-node protocol {theirs} and this node {ours}{}: every node of a \
         cluster must run the same Keel release (stop them all, upgrade them all, start them)",
        if *theirs == 0 { " (0: a build from before protocol numbers)" } else { "" }
    )]
    OtherProtocol { ours: u16, theirs: u16 },
    #[error("it does not know this cluster's secret")]
    BadProof,
    #[error("it refused our proof of the cluster secret (is our join token right?)")]
    Rejected,
}

fn proof(
    secret: &ClusterSecret,
    role: &[u8],
    cluster_id: &[u8; 16],
    client_node: NodeId,
    server_node: NodeId,
    client_nonce: &[u8; 32],
    server_nonce: &[u8; 32],
) -> [u8; 32] {
    let mut hasher = blake3::Hasher::new_keyed(secret.bytes());
    hasher.update(b"keel-rpc handshake proof v1 ");
    hasher.update(role);
    hasher.update(cluster_id);
    hasher.update(&client_node.to_le_bytes());
    hasher.update(&server_node.to_le_bytes());
    hasher.update(client_nonce);
    hasher.update(server_nonce);
    *hasher.finalize().as_bytes()
}

fn session_key(
    context: &str,
    secret: &ClusterSecret,
    cluster_id: &[u8; 16],
    client_nonce: &[u8; 32],
    server_nonce: &[u8; 32],
) -> [u8; 32] {
    let mut material = Vec::with_capacity(32 + 16 + 64);
    material.extend_from_slice(secret.bytes());
    material.extend_from_slice(cluster_id);
    material.extend_from_slice(client_nonce);
    material.extend_from_slice(server_nonce);
    blake3::derive_key(context, &material)
}

fn keys(
    identity: &Identity,
    client_nonce: &[u8; 32],
    server_nonce: &[u8; 32],
) -> ([u8; 32], [u8; 32]) {
    (
        session_key(
            "keel-rpc 2026 session client-to-server",
            &identity.secret,
            &identity.cluster_id,
            client_nonce,
            server_nonce,
        ),
        session_key(
            "keel-rpc 2026 session server-to-client",
            &identity.secret,
            &identity.cluster_id,
            client_nonce,
            server_nonce,
        ),
    )
}

fn constant_time_equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

fn nonce() -> [u8; 32] {
    let mut nonce = [0u8; 32];
    rand::Rng::fill(&mut rand::rngs::OsRng, &mut nonce);
    nonce
}

/// The dialing side. Returns the session and the peer's node id.
pub async fn client<S>(stream: &mut S, identity: &Identity) -> Result<Session, HandshakeError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let client_nonce = nonce();
    let mut hello = [0u8; CLIENT_HELLO_BYTES];
    hello[0..4].copy_from_slice(&HELLO_MAGIC);
    hello[4] = HANDSHAKE_VERSION;
    hello[6..8].copy_from_slice(&PROTOCOL.to_le_bytes());
    hello[8..24].copy_from_slice(&identity.cluster_id);
    hello[24..32].copy_from_slice(&identity.node_id.to_le_bytes());
    hello[32..64].copy_from_slice(&client_nonce);
    stream.write_all(&hello).await?;

    let mut reply = [0u8; SERVER_HELLO_BYTES];
    stream.read_exact(&mut reply).await?;
    if reply[0..4] != HELLO_MAGIC || reply[4] != HANDSHAKE_VERSION {
        return Err(HandshakeError::Protocol);
    }
    if reply[5] == STATUS_OTHER_PROTOCOL || protocol_of(&reply) != PROTOCOL {
        return Err(HandshakeError::OtherProtocol {
            ours: PROTOCOL,
            theirs: protocol_of(&reply),
        });
    }
    let mut their_cluster = [0u8; 16];
    their_cluster.copy_from_slice(&reply[8..24]);
    if reply[5] == STATUS_OTHER_CLUSTER || their_cluster != identity.cluster_id {
        return Err(HandshakeError::OtherCluster {
            ours: hex::encode(identity.cluster_id),
            theirs: hex::encode(their_cluster),
        });
    }
    if reply[5] != STATUS_OK {
        return Err(HandshakeError::Protocol);
    }
    let mut node = [0u8; 8];
    node.copy_from_slice(&reply[24..32]);
    let server_node = u64::from_le_bytes(node);
    let mut server_nonce = [0u8; 32];
    server_nonce.copy_from_slice(&reply[32..64]);
    let mut server_proof = [0u8; 32];
    server_proof.copy_from_slice(&reply[64..96]);
    let expected = proof(
        &identity.secret,
        b"server",
        &identity.cluster_id,
        identity.node_id,
        server_node,
        &client_nonce,
        &server_nonce,
    );
    let server_proved = constant_time_equal(&expected, &server_proof);

    let mut message = [0u8; PROOF_BYTES];
    message[0..4].copy_from_slice(&PROOF_MAGIC);
    message[4..36].copy_from_slice(&proof(
        &identity.secret,
        b"client",
        &identity.cluster_id,
        identity.node_id,
        server_node,
        &client_nonce,
        &server_nonce,
    ));
    stream.write_all(&message).await?;
    if !server_proved {
        return Err(HandshakeError::BadProof);
    }
    let mut verdict = [0u8; 4];
    stream.read_exact(&mut verdict).await?;
    if verdict == REJECT {
        return Err(HandshakeError::Rejected);
    }
    if verdict != ACCEPT {
        return Err(HandshakeError::Protocol);
    }
    let (client_to_server, server_to_client) = keys(identity, &client_nonce, &server_nonce);
    Ok(Session {
        peer_node: server_node,
        client_to_server,
        server_to_client,
    })
}

/// The accepting side. Returns the session (its `peer_node` is the client's claimed id, proven
/// by its knowledge of the secret; 0 for a node not yet a member).
pub async fn server<S>(stream: &mut S, identity: &Identity) -> Result<Session, HandshakeError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut hello = [0u8; CLIENT_HELLO_BYTES];
    stream.read_exact(&mut hello).await?;
    if hello[0..4] != HELLO_MAGIC || hello[4] != HANDSHAKE_VERSION {
        return Err(HandshakeError::Protocol);
    }
    let mut their_cluster = [0u8; 16];
    their_cluster.copy_from_slice(&hello[8..24]);
    let mut node = [0u8; 8];
    node.copy_from_slice(&hello[24..32]);
    let client_node = u64::from_le_bytes(node);
    let mut client_nonce = [0u8; 32];
    client_nonce.copy_from_slice(&hello[32..64]);

    let server_nonce = nonce();
    let mut reply = [0u8; SERVER_HELLO_BYTES];
    reply[0..4].copy_from_slice(&HELLO_MAGIC);
    reply[4] = HANDSHAKE_VERSION;
    reply[6..8].copy_from_slice(&PROTOCOL.to_le_bytes());
    reply[8..24].copy_from_slice(&identity.cluster_id);
    reply[24..32].copy_from_slice(&identity.node_id.to_le_bytes());
    reply[32..64].copy_from_slice(&server_nonce);
    if protocol_of(&hello) != PROTOCOL {
        reply[5] = STATUS_OTHER_PROTOCOL;
        stream.write_all(&reply).await?;
        return Err(HandshakeError::OtherProtocol {
            ours: PROTOCOL,
            theirs: protocol_of(&hello),
        });
    }
    if their_cluster != identity.cluster_id {
        reply[5] = STATUS_OTHER_CLUSTER;
        stream.write_all(&reply).await?;
        return Err(HandshakeError::OtherCluster {
            ours: hex::encode(identity.cluster_id),
            theirs: hex::encode(their_cluster),
        });
    }
    reply[64..96].copy_from_slice(&proof(
        &identity.secret,
        b"server",
        &identity.cluster_id,
        client_node,
        identity.node_id,
        &client_nonce,
        &server_nonce,
    ));
    stream.write_all(&reply).await?;

    let mut message = [0u8; PROOF_BYTES];
    stream.read_exact(&mut message).await?;
    if message[0..4] != PROOF_MAGIC {
        return Err(HandshakeError::Protocol);
    }
    let mut client_proof = [0u8; 32];
    client_proof.copy_from_slice(&message[4..36]);
    let expected = proof(
        &identity.secret,
        b"client",
        &identity.cluster_id,
        client_node,
        identity.node_id,
        &client_nonce,
        &server_nonce,
    );
    if !constant_time_equal(&expected, &client_proof) {
        let _ = stream.write_all(&REJECT).await;
        return Err(HandshakeError::BadProof);
    }
    stream.write_all(&ACCEPT).await?;
    let (client_to_server, server_to_client) = keys(identity, &client_nonce, &server_nonce);
    Ok(Session {
        peer_node: client_node,
        client_to_server,
        server_to_client,
    })
}
