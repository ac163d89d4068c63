//! The on-disk format of segment files and extents (version 1). `docs/on-disk-format.md` is the
//! prose twin of this file; the golden-bytes tests at the bottom pin the layout so that a change
//! to it is a deliberate, versioned decision.
//!
//! Segment file: a 64-byte segment header, then extents back to back, each padded to 8 bytes.
//! Extent: a 68-byte header, the key, the payload (compressed or raw), zero padding.
//! The header's CRC32C covers header bytes 0..64 and the key; a second CRC32C covers the payload
//! as stored. Decoding checks every length against its bound before trusting it.

use std::borrow::Cow;

use crate::error::{StoreError, StoreResult};

pub const SEGMENT_MAGIC: [u8; 8] = *b"KEELSEG1";
pub const SEGMENT_HEADER_LEN: usize = 64;
pub const FORMAT_VERSION: u32 = 1;

pub const EXTENT_MAGIC: [u8; 4] = *b"KXT1";
pub const EXTENT_HEADER_LEN: usize = 68;
pub const KEY_LEN_MAX_BYTES: usize = 2048;
/// Largest value one extent holds. Object chunks are 1 MiB; metadata records stay far below.
pub const VALUE_LEN_MAX_BYTES: usize = 64 << 20;

pub const KIND_PUT: u8 = 1;
pub const KIND_DELETE: u8 = 2;

/// The last extent of a [`crate::Store::write`] call: recovery applies a group only when it sees
/// this flag, so a torn batch never applies half of a caller's ops.
pub const FLAG_GROUP_END: u8 = 1 << 0;
/// The header carries a BLAKE3 hash of the uncompressed payload.
pub const FLAG_CONTENT_HASH: u8 = 1 << 1;
/// Written by compaction: a copy of an older extent keeping that extent's sequence number.
/// Recovery applies it only if the key still maps to that sequence number.
pub const FLAG_RELOCATED: u8 = 1 << 2;
/// The first extent of a batch written after an `fdatasync` returned: everything before it in
/// the log was durable when it was written. Recovery uses it to tell a torn tail (unsynced bytes
/// lost at a power cut) from media corruption in the middle of the log.
pub const FLAG_AFTER_SYNC: u8 = 1 << 3;

/// Per-extent compression. Chosen by the caller per namespace (bucket, volume); an extent whose
/// compressed form is not smaller than its raw form is stored raw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    #[default]
    None,
    Lz4,
    Zstd,
}

impl Compression {
    pub fn code(self) -> u8 {
        match self {
            Compression::None => 0,
            Compression::Lz4 => 1,
            Compression::Zstd => 2,
        }
    }

    pub fn from_code(code: u8) -> Option<Compression> {
        match code {
            0 => Some(Compression::None),
            1 => Some(Compression::Lz4),
            2 => Some(Compression::Zstd),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Lz4 => "lz4",
            Compression::Zstd => "zstd",
        }
    }

    pub fn from_name(name: &str) -> Option<Compression> {
        match name {
            "none" | "off" => Some(Compression::None),
            "lz4" => Some(Compression::Lz4),
            "zstd" => Some(Compression::Zstd),
            _ => None,
        }
    }
}

/// zstd level 1 keeps compression near disk speed; the ratio difference to level 3 is small on
/// database pages.
const ZSTD_LEVEL: i32 = 1;

/// Compresses `raw` with `compression`; returns the codec actually used and the stored bytes
/// (raw when compression does not pay).
pub fn compress(raw: &[u8], compression: Compression) -> (Compression, Vec<u8>) {
    let packed = match compression {
        Compression::None => None,
        Compression::Lz4 => Some(lz4_flex::block::compress(raw)),
        Compression::Zstd => zstd::bulk::compress(raw, ZSTD_LEVEL).ok(),
    };
    match packed {
        Some(bytes) if bytes.len() < raw.len() => (compression, bytes),
        _ => (Compression::None, raw.to_vec()),
    }
}

pub fn decompress(
    stored: &[u8],
    compression: Compression,
    raw_len: usize,
) -> Result<Vec<u8>, String> {
    let raw = match compression {
        Compression::None => stored.to_vec(),
        Compression::Lz4 => {
            lz4_flex::block::decompress(stored, raw_len).map_err(|e| e.to_string())?
        }
        Compression::Zstd => zstd::bulk::decompress(stored, raw_len).map_err(|e| e.to_string())?,
    };
    if raw.len() != raw_len {
        return Err(format!(
            "decompressed to {} bytes, header says {raw_len}",
            raw.len()
        ));
    }
    Ok(raw)
}

/// The fixed part of an extent header, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtentHeader {
    pub kind: u8,
    pub compression: Compression,
    pub flags: u8,
    pub seq: u64,
    pub key_len: usize,
    pub stored_len: usize,
    pub raw_len: usize,
    pub payload_crc: u32,
    pub content_hash: [u8; 32],
}

impl ExtentHeader {
    /// Bytes the whole extent occupies in the segment, padding included.
    pub fn record_len(&self) -> usize {
        record_len(self.key_len, self.stored_len)
    }
}

pub fn record_len(key_len: usize, stored_len: usize) -> usize {
    (EXTENT_HEADER_LEN + key_len + stored_len).div_ceil(8) * 8
}

/// Encodes one extent into `out`, exactly [`record_len`] bytes (padding included). `stored` is
/// the payload as it goes to disk. The caller lays a whole batch into one buffer this way,
/// each record at its place.
#[allow(clippy::too_many_arguments)]
pub fn encode_extent(
    out: &mut [u8],
    kind: u8,
    compression: Compression,
    flags: u8,
    seq: u64,
    key: &[u8],
    stored: &[u8],
    raw_len: usize,
    content_hash: Option<&[u8; 32]>,
) {
    assert!(
        key.len() <= KEY_LEN_MAX_BYTES,
        "key length checked by the caller"
    );
    assert!(
        stored.len() <= VALUE_LEN_MAX_BYTES + 1024,
        "value length checked by the caller"
    );
    assert_eq!(
        out.len(),
        record_len(key.len(), stored.len()),
        "record length computed by the caller"
    );
    let flags = if content_hash.is_some() {
        flags | FLAG_CONTENT_HASH
    } else {
        flags
    };
    let mut at = 0;
    let header: [&[u8]; 8] = [
        &EXTENT_MAGIC,
        &[kind, compression.code(), flags, 0],
        &seq.to_le_bytes(),
        &(key.len() as u32).to_le_bytes(),
        &(stored.len() as u32).to_le_bytes(),
        &(raw_len as u32).to_le_bytes(),
        &crc32c(stored).to_le_bytes(),
        content_hash.unwrap_or(&[0u8; 32]),
    ];
    for bytes in header {
        put(out, &mut at, bytes);
    }
    debug_assert_eq!(at, 64);
    let header_crc = crc32c_of(&[&out[..64], key]);
    for bytes in [&header_crc.to_le_bytes()[..], key, stored] {
        put(out, &mut at, bytes);
    }
    out[at..].fill(0);
}

/// Copies `bytes` into `out` at `*at`, and moves `*at` past them.
fn put(out: &mut [u8], at: &mut usize, bytes: &[u8]) {
    out[*at..*at + bytes.len()].copy_from_slice(bytes);
    *at += bytes.len();
}

fn le_u32(bytes: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(b)
}

fn le_u64(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

/// Decodes and bounds-checks the 64 fixed header bytes; the header CRC is checked by
/// [`verify_header`] once the key is at hand.
pub fn decode_header(bytes: &[u8]) -> Result<ExtentHeader, String> {
    if bytes.len() < EXTENT_HEADER_LEN {
        return Err(format!("header truncated at {} bytes", bytes.len()));
    }
    if bytes[0..4] != EXTENT_MAGIC {
        return Err("bad extent magic".into());
    }
    let kind = bytes[4];
    if kind != KIND_PUT && kind != KIND_DELETE {
        return Err(format!("unknown extent kind {kind}"));
    }
    let compression = Compression::from_code(bytes[5])
        .ok_or_else(|| format!("unknown compression {}", bytes[5]))?;
    let key_len = le_u32(bytes, 16) as usize;
    let stored_len = le_u32(bytes, 20) as usize;
    let raw_len = le_u32(bytes, 24) as usize;
    if key_len == 0 || key_len > KEY_LEN_MAX_BYTES {
        return Err(format!("key length {key_len} out of bounds"));
    }
    if stored_len > VALUE_LEN_MAX_BYTES + 1024 || raw_len > VALUE_LEN_MAX_BYTES {
        return Err(format!(
            "payload length {stored_len}/{raw_len} out of bounds"
        ));
    }
    let mut content_hash = [0u8; 32];
    content_hash.copy_from_slice(&bytes[32..64]);
    Ok(ExtentHeader {
        kind,
        compression,
        flags: bytes[6],
        seq: le_u64(bytes, 8),
        key_len,
        stored_len,
        raw_len,
        payload_crc: le_u32(bytes, 28),
        content_hash,
    })
}

/// CRC-32C (Castagnoli), computed by `crc-fast`: its carry-less-multiply code checks a 4 KiB
/// block 3-4× as fast as the `crc32c` crate's CRC instructions on this machine's CPU (the same
/// checksum; every block read and written pays it).
fn crc32c(bytes: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(bytes)
}

/// [`crc32c`] of `parts` one after another.
fn crc32c_of(parts: &[&[u8]]) -> u32 {
    let mut digest = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
    for part in parts {
        digest.update(part);
    }
    digest.finalize() as u32
}

/// Checks the header CRC (header bytes 0..64 and the key).
pub fn verify_header(header_bytes: &[u8], key: &[u8]) -> Result<(), String> {
    let expected = le_u32(header_bytes, 64);
    let actual = crc32c_of(&[&header_bytes[0..64], key]);
    if expected != actual {
        return Err(format!(
            "header checksum mismatch (stored {expected:08x}, computed {actual:08x})"
        ));
    }
    Ok(())
}

/// A whole extent read from disk: verifies both checksums and, when present, the content hash,
/// and returns the key and the uncompressed value.
pub fn decode_extent(record: &[u8]) -> Result<(ExtentHeader, Vec<u8>, Vec<u8>), String> {
    let extent = decode_extent_ref(record)?;
    Ok((
        extent.header,
        extent.key.to_vec(),
        extent.value.into_owned(),
    ))
}

/// An extent decoded and verified in place: the key, and the value of an uncompressed extent,
/// borrow from the record.
pub struct ExtentRef<'a> {
    pub header: ExtentHeader,
    pub key: &'a [u8],
    pub value: Cow<'a, [u8]>,
}

/// [`decode_extent`] without copies.
pub fn decode_extent_ref(record: &[u8]) -> Result<ExtentRef<'_>, String> {
    let header = decode_header(record)?;
    if record.len() < header.record_len() {
        return Err(format!(
            "extent truncated: {} of {} bytes",
            record.len(),
            header.record_len()
        ));
    }
    let key_end = EXTENT_HEADER_LEN + header.key_len;
    let key = &record[EXTENT_HEADER_LEN..key_end];
    verify_header(record, key)?;
    let stored = &record[key_end..key_end + header.stored_len];
    let crc = crc32c(stored);
    if crc != header.payload_crc {
        return Err(format!(
            "payload checksum mismatch (stored {:08x}, computed {crc:08x})",
            header.payload_crc
        ));
    }
    let value = match header.compression {
        Compression::None if stored.len() == header.raw_len => Cow::Borrowed(stored),
        compression => Cow::Owned(decompress(stored, compression, header.raw_len)?),
    };
    if header.flags & FLAG_CONTENT_HASH != 0
        && blake3::hash(&value).as_bytes() != &header.content_hash
    {
        return Err("content hash mismatch".into());
    }
    Ok(ExtentRef { header, key, value })
}

/// The 64-byte segment header: magic, format version, segment id, store id, CRC32C.
pub fn encode_segment_header(segment_id: u64, store_id: &[u8; 16]) -> [u8; SEGMENT_HEADER_LEN] {
    let mut out = [0u8; SEGMENT_HEADER_LEN];
    out[0..8].copy_from_slice(&SEGMENT_MAGIC);
    out[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    out[16..24].copy_from_slice(&segment_id.to_le_bytes());
    out[24..40].copy_from_slice(store_id);
    let crc = crc32c(&out[0..60]);
    out[60..64].copy_from_slice(&crc.to_le_bytes());
    out
}

/// Returns (segment id, store id) after checking magic, version and CRC.
pub fn decode_segment_header(bytes: &[u8]) -> StoreResult<(u64, [u8; 16])> {
    let bad = |why: &str| StoreError::Invalid(format!("segment header: {why}"));
    if bytes.len() < SEGMENT_HEADER_LEN {
        return Err(bad("truncated"));
    }
    if bytes[0..8] != SEGMENT_MAGIC {
        return Err(bad("bad magic"));
    }
    if le_u32(bytes, 60) != crc32c(&bytes[0..60]) {
        return Err(bad("checksum mismatch"));
    }
    let version = le_u32(bytes, 8);
    if version != FORMAT_VERSION {
        return Err(bad(&format!(
            "format version {version}, this build reads {FORMAT_VERSION}"
        )));
    }
    let mut store_id = [0u8; 16];
    store_id.copy_from_slice(&bytes[24..40]);
    Ok((le_u64(bytes, 16), store_id))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Pins the exact bytes of an extent: a change to the layout must change FORMAT_VERSION and
    /// this golden vector together, on purpose.
    #[test]
    fn extent_golden_bytes() {
        let mut out = vec![0; record_len(2, 5)];
        encode_extent(
            &mut out,
            KIND_PUT,
            Compression::None,
            FLAG_GROUP_END,
            7,
            b"k1",
            b"hello",
            5,
            None,
        );
        let golden = "4b5854310100010007000000000000000200000005000000050000004cbb719a\
                      0000000000000000000000000000000000000000000000000000000000000000\
                      f339be366b3168656c6c6f0000000000";
        assert_eq!(hex(&out), golden.replace(' ', ""));
        let (header, key, value) = decode_extent(&out).unwrap();
        assert_eq!(
            (header.seq, key.as_slice(), value.as_slice()),
            (7, &b"k1"[..], &b"hello"[..])
        );
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Every single-bit flip of an encoded extent is detected (header CRC, payload CRC, bounds).
    #[test]
    fn every_bit_flip_is_detected() {
        let value = vec![0x5a; 300];
        let mut out = vec![0; record_len(3, value.len())];
        let hash = *blake3::hash(&value).as_bytes();
        encode_extent(
            &mut out,
            KIND_PUT,
            Compression::None,
            0,
            9,
            b"key",
            &value,
            300,
            Some(&hash),
        );
        let used = EXTENT_HEADER_LEN + 3 + 300;
        for bit in 0..used * 8 {
            let mut copy = out.clone();
            copy[bit / 8] ^= 1 << (bit % 8);
            assert!(
                decode_extent(&copy).is_err(),
                "flip of bit {bit} went unnoticed"
            );
        }
    }

    /// Compression round-trips and falls back to raw when it does not pay.
    #[test]
    fn compression_round_trip_and_fallback() {
        let text = b"postgres page postgres page postgres page ".repeat(100);
        for codec in [Compression::Lz4, Compression::Zstd] {
            let (used, stored) = compress(&text, codec);
            assert_eq!(used, codec);
            assert!(stored.len() < text.len());
            assert_eq!(decompress(&stored, used, text.len()).unwrap(), text);
        }
        let mut noise = vec![0u8; 4096];
        blake3::Hasher::new()
            .update(b"seed")
            .finalize_xof()
            .fill(&mut noise);
        let (used, stored) = compress(&noise, Compression::Zstd);
        assert_eq!(used, Compression::None);
        assert_eq!(stored, noise);
    }

    #[test]
    fn segment_header_round_trip() {
        let header = encode_segment_header(42, &[3u8; 16]);
        assert_eq!(decode_segment_header(&header).unwrap(), (42, [3u8; 16]));
        let mut bad = header;
        bad[20] ^= 1;
        assert!(decode_segment_header(&bad).is_err());
    }
}
