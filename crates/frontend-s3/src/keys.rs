//! Generating access keys and upload ids from the operating system's randomness.
//!
//! Access key ids look like AWS ones (20 upper-case letters and digits, starting `GK`), secrets
//! are 40 characters from the base64 alphabet without `+` and `/` so they paste anywhere.

use rand::distributions::Alphanumeric;
use rand::Rng;

use crate::error::FrontendError;

/// Length of a generated access key id.
pub const ACCESS_KEY_ID_LENGTH: usize = 20;
/// Length of a generated secret.
pub const SECRET_LENGTH: usize = 40;

pub fn random_hex(bytes: usize) -> String {
    let mut buffer = vec![0u8; bytes];
    rand::rngs::OsRng.fill(buffer.as_mut_slice());
    hex::encode(buffer)
}

pub fn new_access_key_id() -> String {
    let tail: String = rand::rngs::OsRng
        .sample_iter(&Alphanumeric)
        .map(|b| (b as char).to_ascii_uppercase())
        .take(ACCESS_KEY_ID_LENGTH - 2)
        .collect();
    format!("GK{tail}")
}

pub fn new_secret() -> String {
    rand::rngs::OsRng
        .sample_iter(&Alphanumeric)
        .map(char::from)
        .take(SECRET_LENGTH)
        .collect()
}

/// Access key ids: 3 to 128 ASCII letters and digits (they appear in signed headers and URLs).
pub fn validate_access_key_id(id: &str) -> Result<(), FrontendError> {
    if (3..=128).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        Ok(())
    } else {
        Err(FrontendError::InvalidAccessKeyId(
            id.chars().take(140).collect(),
        ))
    }
}

/// Secrets: 8 to 128 printable ASCII characters.
pub fn validate_secret(secret: &str) -> Result<(), FrontendError> {
    if (8..=128).contains(&secret.len()) && secret.bytes().all(|b| (0x21..0x7f).contains(&b)) {
        Ok(())
    } else {
        Err(FrontendError::InvalidSecret)
    }
}
