//! Frames: a fixed 32-byte header, a 16-byte MAC, then the payload (`docs/rpc.md`).
//!
//! ```text
//! offset size field
//!      0    4 magic "KRPC"
//!      4    1 version (1)
//!      5    1 kind: 1 request, 2 response, 3 error answer
//!      6    2 method (requests; 0 otherwise)
//!      8    8 request id (answers carry their request's)
//!     16    4 deadline budget in milliseconds left when sent (0: none)
//!     20    4 payload length
//!     24    8 reserved, zero
//!     32   16 MAC: keyed BLAKE3 (the direction's session key) of the frame counter (u64 LE),
//!             the header and the payload, first 16 bytes
//!     48    n payload
//! ```
//!
//! The counter is the number of frames sent before this one in this direction of this
//! connection: it is not sent, both sides count, so a frame replayed, dropped, reordered or
//! moved to another connection fails its MAC. All integers little-endian.
//!
//! Decoding checks the header (magic, version, kind, length within the limit, reserved bytes
//! zero) before reading or allocating the payload, and the MAC before handing anything out.

use serde::{Deserialize, Serialize};

pub const MAGIC: [u8; 4] = *b"KRPC";
pub const VERSION: u8 = 1;
pub const HEADER_BYTES: usize = 32;
pub const MAC_BYTES: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Request = 1,
    Response = 2,
    Error = 3,
}

impl Kind {
    fn from_byte(byte: u8) -> Option<Kind> {
        match byte {
            1 => Some(Kind::Request),
            2 => Some(Kind::Response),
            3 => Some(Kind::Error),
            _ => None,
        }
    }
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub method: u16,
    pub request_id: u64,
    pub deadline_ms: u32,
    pub length: u32,
}

/// Why bytes are not a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic {0:02x?} (not a Keel node-to-node connection?)")]
    Magic([u8; 4]),
    #[error("frame version {0}, this build speaks {VERSION}")]
    Version(u8),
    #[error("unknown frame kind {0}")]
    Kind(u8),
    #[error("payload of {length} bytes over the {limit}-byte limit")]
    TooLarge { length: u32, limit: u32 },
    #[error("reserved header bytes are not zero")]
    Reserved,
    #[error("the frame's MAC does not match (corrupted, forged, replayed or reordered)")]
    Mac,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0..4].copy_from_slice(&MAGIC);
        out[4] = VERSION;
        out[5] = self.kind as u8;
        out[6..8].copy_from_slice(&self.method.to_le_bytes());
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        out[16..20].copy_from_slice(&self.deadline_ms.to_le_bytes());
        out[20..24].copy_from_slice(&self.length.to_le_bytes());
        out
    }

    /// Parses and checks a header; `payload_max_bytes` bounds the length.
    pub fn decode(
        bytes: &[u8; HEADER_BYTES],
        payload_max_bytes: u32,
    ) -> Result<Header, FrameError> {
        let field = |at: usize, len: usize| &bytes[at..at + len];
        let magic: [u8; 4] = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if magic != MAGIC {
            return Err(FrameError::Magic(magic));
        }
        if bytes[4] != VERSION {
            return Err(FrameError::Version(bytes[4]));
        }
        let kind = Kind::from_byte(bytes[5]).ok_or(FrameError::Kind(bytes[5]))?;
        if field(24, 8).iter().any(|&byte| byte != 0) {
            return Err(FrameError::Reserved);
        }
        let u16_at = |at: usize| u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        let u32_at = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let mut id = [0u8; 8];
        id.copy_from_slice(field(8, 8));
        let length = u32_at(20);
        if length > payload_max_bytes {
            return Err(FrameError::TooLarge {
                length,
                limit: payload_max_bytes,
            });
        }
        Ok(Header {
            kind,
            method: u16_at(6),
            request_id: u64::from_le_bytes(id),
            deadline_ms: u32_at(16),
            length,
        })
    }
}

/// The MAC of the frame with this counter, header and payload.
pub fn mac(
    key: &[u8; 32],
    counter: u64,
    header: &[u8; HEADER_BYTES],
    payload: &[u8],
) -> [u8; MAC_BYTES] {
    mac_of_parts(key, counter, header, &[payload])
}

/// [`mac`] of a payload held as parts, one after another.
pub fn mac_of_parts<P: AsRef<[u8]>>(
    key: &[u8; 32],
    counter: u64,
    header: &[u8; HEADER_BYTES],
    parts: &[P],
) -> [u8; MAC_BYTES] {
    let mut hasher = blake3::Hasher::new_keyed(key);
    hasher.update(&counter.to_le_bytes());
    hasher.update(header);
    for part in parts {
        hasher.update(part.as_ref());
    }
    let hash = hasher.finalize();
    let mut out = [0u8; MAC_BYTES];
    out.copy_from_slice(&hash.as_bytes()[..MAC_BYTES]);
    out
}

/// Constant-time comparison of two MACs.
pub fn mac_matches(a: &[u8; MAC_BYTES], b: &[u8; MAC_BYTES]) -> bool {
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

/// Appends one whole frame to `out`.
pub fn encode_frame(
    out: &mut Vec<u8>,
    key: &[u8; 32],
    counter: u64,
    header: &Header,
    payload: &[u8],
) {
    encode_frame_parts(out, key, counter, header, &[payload]);
}

/// [`encode_frame`] of a payload held as parts.
pub fn encode_frame_parts<P: AsRef<[u8]>>(
    out: &mut Vec<u8>,
    key: &[u8; 32],
    counter: u64,
    header: &Header,
    parts: &[P],
) {
    out.extend_from_slice(&frame_head(key, counter, header, parts));
    for part in parts {
        out.extend_from_slice(part.as_ref());
    }
}

/// What precedes a frame's payload (held as parts) on the wire: its header and MAC.
pub fn frame_head<P: AsRef<[u8]>>(
    key: &[u8; 32],
    counter: u64,
    header: &Header,
    parts: &[P],
) -> [u8; HEADER_BYTES + MAC_BYTES] {
    let encoded = header.encode();
    let mut head = [0u8; HEADER_BYTES + MAC_BYTES];
    head[..HEADER_BYTES].copy_from_slice(&encoded);
    head[HEADER_BYTES..].copy_from_slice(&mac_of_parts(key, counter, &encoded, parts));
    head
}

/// Decodes one frame from the start of `bytes` (tests and fuzzing; the connection reads header,
/// MAC and payload from the socket with the same checks). Returns the header, the payload and
/// the bytes consumed, `Ok(None)` if more bytes are needed.
pub fn decode_frame(
    bytes: &[u8],
    key: &[u8; 32],
    counter: u64,
    payload_max_bytes: u32,
) -> Result<Option<(Header, Vec<u8>, usize)>, FrameError> {
    if bytes.len() < HEADER_BYTES + MAC_BYTES {
        return Ok(None);
    }
    let mut header_bytes = [0u8; HEADER_BYTES];
    header_bytes.copy_from_slice(&bytes[..HEADER_BYTES]);
    let header = Header::decode(&header_bytes, payload_max_bytes)?;
    let total = HEADER_BYTES + MAC_BYTES + header.length as usize;
    if bytes.len() < total {
        return Ok(None);
    }
    let mut received = [0u8; MAC_BYTES];
    received.copy_from_slice(&bytes[HEADER_BYTES..HEADER_BYTES + MAC_BYTES]);
    let payload = &bytes[HEADER_BYTES + MAC_BYTES..total];
    if !mac_matches(&received, &mac(key, counter, &header_bytes, payload)) {
        return Err(FrameError::Mac);
    }
    Ok(Some((header, payload.to_vec(), total)))
}

/// What an error answer carries: the handler's code and message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteError {
    pub code: u16,
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves a frame round-trips and that every single-bit flip of it is refused or incomplete.
    #[test]
    fn frames_round_trip_and_every_bit_flip_is_caught() {
        let key = [7u8; 32];
        let header = Header {
            kind: Kind::Request,
            method: 11,
            request_id: 42,
            deadline_ms: 1500,
            length: 5,
        };
        let mut frame = Vec::new();
        encode_frame(&mut frame, &key, 3, &header, b"hello");
        let (decoded, payload, used) = decode_frame(&frame, &key, 3, 1 << 20)
            .expect("valid")
            .expect("complete");
        assert_eq!(
            (decoded, payload.as_slice(), used),
            (header, &b"hello"[..], frame.len())
        );
        assert_eq!(
            decode_frame(&frame, &key, 4, 1 << 20),
            Err(FrameError::Mac),
            "replayed"
        );
        for bit in 0..frame.len() * 8 {
            let mut flipped = frame.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            let outcome = decode_frame(&flipped, &key, 3, 1 << 20);
            assert!(
                !matches!(outcome, Ok(Some(_))),
                "bit {bit} flipped and the frame was accepted"
            );
        }
    }
}
