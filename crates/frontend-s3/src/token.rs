//! ListObjectsV2 continuation tokens and S3's `encoding-type=url` key encoding.
//!
//! A token is URL-safe base64 (no padding) of a version byte, a kind byte (`k`: resume after this
//! key, `p`: resume after every key under this common prefix) and the UTF-8 name. Tokens come back
//! from clients, so decoding accepts any input and fails cleanly.

use base64::Engine as _;
use keel_namespace::object::list::ListStart;
use keel_namespace::object::KEY_LENGTH_MAX_BYTES;

const TOKEN_VERSION: u8 = 1;

pub fn encode_token(start: &ListStart) -> String {
    let (kind, name) = match start {
        ListStart::AfterKey(key) => (b'k', key),
        ListStart::AfterPrefix(prefix) => (b'p', prefix),
    };
    let mut raw = vec![TOKEN_VERSION, kind];
    raw.extend_from_slice(name.as_bytes());
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
}

pub fn decode_token(token: &str) -> Option<ListStart> {
    if token.len() > 2 * KEY_LENGTH_MAX_BYTES + 16 {
        return None;
    }
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token.trim())
        .ok()?;
    let (&version, rest) = raw.split_first()?;
    if version != TOKEN_VERSION {
        return None;
    }
    let (&kind, name) = rest.split_first()?;
    if name.len() > KEY_LENGTH_MAX_BYTES {
        return None;
    }
    let name = String::from_utf8(name.to_vec()).ok()?;
    match kind {
        b'k' => Some(ListStart::AfterKey(name)),
        b'p' => Some(ListStart::AfterPrefix(name)),
        _ => None,
    }
}

/// Percent-encodes every byte but unreserved characters and `/`, as S3 does for
/// `encoding-type=url` responses.
pub fn url_encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}
