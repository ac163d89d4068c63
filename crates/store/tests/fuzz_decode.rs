//! Fuzz-style tests of the on-disk decoders: arbitrary and mutated bytes never panic, never
//! decode into a record whose checksum does not hold, and recovery over a segment full of
//! garbage opens cleanly. (A cargo-fuzz target for the same decoder lives in `crates/store/fuzz`.)

#![allow(clippy::unwrap_used)]

mod common;

use keel_store::format::{self, Compression};
use proptest::prelude::*;

fn valid_extent(key: &[u8], value: &[u8], codec: u8) -> Vec<u8> {
    let codec = [Compression::None, Compression::Lz4, Compression::Zstd][codec as usize % 3];
    let (used, stored) = format::compress(value, codec);
    let hash = *blake3::hash(value).as_bytes();
    let mut out = vec![0; format::record_len(key.len(), stored.len())];
    format::encode_extent(
        &mut out,
        format::KIND_PUT,
        used,
        format::FLAG_GROUP_END,
        1,
        key,
        &stored,
        value.len(),
        Some(&hash),
    );
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Random bytes: decoding returns an error or a record that re-encodes to the same bytes.
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = format::decode_segment_header(&bytes);
        if let Ok((header, key, value)) = format::decode_extent(&bytes) {
            prop_assert_eq!(valid_extent(&key, &value, header.compression.code()).len(), header.record_len());
        }
    }

    /// Mutations of a valid extent (byte overwrites, truncation) are rejected, or decode to the
    /// original key and value (a mutation of padding bytes).
    #[test]
    fn mutated_extents_are_caught(
        key in proptest::collection::vec(any::<u8>(), 1..40),
        value in proptest::collection::vec(any::<u8>(), 0..600),
        codec in 0u8..3,
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let original = valid_extent(&key, &value, codec);
        let mut mutated = original.clone();
        for (at, byte) in &edits {
            let i = at.index(mutated.len());
            mutated[i] = *byte;
        }
        if truncate {
            mutated.truncate(cut.index(mutated.len()));
        }
        if let Ok((_, decoded_key, decoded_value)) = format::decode_extent(&mutated) {
            prop_assert_eq!(decoded_key, key);
            prop_assert_eq!(decoded_value, value);
        }
    }
}

/// A segment whose records are followed by megabytes of garbage opens, keeps what was written,
/// and appends after the cut.
#[test]
fn recovery_over_garbage_tail_opens_cleanly() {
    use std::io::Write;
    let dir = common::fresh_dir("fuzz-garbage-tail");
    let store = common::open(std::slice::from_ref(&dir));
    store
        .write(
            vec![keel_store::WriteOp::put(
                b"\x01k".to_vec(),
                b"v".to_vec(),
                Compression::None,
            )],
            keel_store::Durability::Sync,
        )
        .unwrap();
    drop(store);
    let segment = common::segment_files(&dir).pop().unwrap();
    let mut garbage = vec![0u8; 2 << 20];
    blake3::Hasher::new()
        .update(b"garbage")
        .finalize_xof()
        .fill(&mut garbage);
    // Sprinkle valid magics so the decoder has to reject on checksums, not on magic alone.
    for at in (0..garbage.len()).step_by(4096) {
        garbage[at..at + 4].copy_from_slice(&format::EXTENT_MAGIC);
    }
    std::fs::OpenOptions::new()
        .append(true)
        .open(&segment)
        .unwrap()
        .write_all(&garbage)
        .unwrap();
    let store = common::open(std::slice::from_ref(&dir));
    assert_eq!(store.get(b"\x01k").unwrap().unwrap(), b"v");
    store
        .write(
            vec![keel_store::WriteOp::put(
                b"\x01k2".to_vec(),
                b"v2".to_vec(),
                Compression::None,
            )],
            keel_store::Durability::Sync,
        )
        .unwrap();
    drop(store);
    let store = common::open(&[dir]);
    assert_eq!(store.get(b"\x01k2").unwrap().unwrap(), b"v2");
}
