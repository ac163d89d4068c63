//! Property tests (bounded fuzzing) of the request handling Keel owns: bucket and key validation,
//! manifest decoding, conditional-request evaluation, copy-source ranges, list continuation
//! tokens and URL encoding. Every decoder must refuse garbage without panicking and round-trip
//! what it encodes.
#![allow(clippy::unwrap_used)]

use keel_namespace::object::list::ListStart;
use keel_namespace::object::records::{self, ChunkRef, Content, Manifest};
use keel_namespace::object::{
    validate_bucket_name, validate_object_key, Checksums, StoredHeaders, KEY_LENGTH_MAX_BYTES,
};
use keel_s3::read::{evaluate, parse_copy_range, Conditions, Precondition};
use keel_s3::token::{decode_token, encode_token, url_encode};
use proptest::prelude::*;

fn manifest_strategy() -> impl Strategy<Value = Manifest> {
    let chunks = proptest::collection::vec(
        (any::<[u8; 32]>(), 1u32..=(1 << 20))
            .prop_map(|(hash, length_bytes)| ChunkRef { hash, length_bytes }),
        0..20,
    );
    let content = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..100).prop_map(Content::Inline),
        chunks.prop_map(Content::Chunks),
    ];
    (
        content,
        "[a-f0-9]{32}(-[0-9]{1,3})?",
        any::<i64>(),
        proptest::collection::vec(("[a-z]{1,8}", ".{0,16}"), 0..4),
        proptest::option::of(".{0,20}"),
    )
        .prop_map(
            |(content, etag, modified_unix_ms, metadata, content_type)| {
                let size_bytes = match &content {
                    Content::Inline(data) => data.len() as u64,
                    Content::Chunks(chunks) => {
                        chunks.iter().map(|c| u64::from(c.length_bytes)).sum()
                    }
                };
                Manifest {
                    size_bytes,
                    etag,
                    modified_unix_ms,
                    content,
                    part_sizes_bytes: Vec::new(),
                    headers: StoredHeaders {
                        content_type,
                        ..Default::default()
                    },
                    metadata,
                    checksums: Checksums::default(),
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

    // Bucket names: accepted names obey S3's rules; validation never panics.
    #[test]
    fn bucket_name_validation(name in ".{0,70}") {
        if validate_bucket_name(&name).is_ok() {
            prop_assert!((3..=63).contains(&name.len()));
            prop_assert!(name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-'));
            prop_assert!(!name.contains(".."));
        }
    }

    // Object keys: accepted exactly when 1..=1024 bytes without NUL; `..` and `/` are fine.
    #[test]
    fn object_key_validation(key in "(\\PC|\\.\\.|/|\u{0}){0,600}") {
        let ok = !key.is_empty() && key.len() <= KEY_LENGTH_MAX_BYTES && !key.contains('\0');
        prop_assert_eq!(validate_object_key(&key).is_ok(), ok);
    }

    // Manifests round-trip through their encoding.
    #[test]
    fn manifest_round_trip(manifest in manifest_strategy()) {
        let bytes = records::encode(&manifest);
        prop_assert_eq!(records::decode_manifest(&bytes).unwrap(), manifest);
    }

    // Arbitrary bytes and mutated manifests never panic the decoder; what decodes is consistent.
    #[test]
    fn manifest_decode_garbage(
        manifest in manifest_strategy(),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        garbage in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let _ = records::decode_manifest(&garbage);
        let mut bytes = records::encode(&manifest);
        for (position, value) in flips {
            let index = position % bytes.len();
            bytes[index] ^= value;
        }
        if let Ok(decoded) = records::decode_manifest(&bytes) {
            prop_assert!(decoded.check().is_ok());
        }
    }

    // Continuation tokens round-trip; any client string decodes or is refused without panic.
    #[test]
    fn continuation_tokens(name in "\\PC{0,300}", is_prefix in any::<bool>(), garbage in "\\PC{0,400}") {
        let start = if is_prefix { ListStart::AfterPrefix(name) } else { ListStart::AfterKey(name) };
        prop_assert_eq!(decode_token(&encode_token(&start)), Some(start));
        if let Some(ListStart::AfterKey(k) | ListStart::AfterPrefix(k)) = decode_token(&garbage) {
            prop_assert!(k.len() <= KEY_LENGTH_MAX_BYTES);
        }
    }

    // URL encoding emits only unreserved characters, '/' and %XX, and decodes back.
    #[test]
    fn url_encoding(value in "\\PC{0,100}") {
        let encoded = url_encode(&value);
        prop_assert!(encoded.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.~/%".contains(&b)));
        let mut decoded = Vec::new();
        let bytes = encoded.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'%' {
                decoded.push(u8::from_str_radix(&encoded[i + 1..i + 3], 16).unwrap());
                i += 3;
            } else {
                decoded.push(bytes[i]);
                i += 1;
            }
        }
        prop_assert_eq!(String::from_utf8(decoded).unwrap(), value);
    }

    // Copy-source ranges: accepted ranges are well-formed; parsing never panics.
    #[test]
    fn copy_ranges(first in any::<u64>(), last in any::<u64>(), garbage in "\\PC{0,40}") {
        let parsed = parse_copy_range(&format!("bytes={first}-{last}"));
        prop_assert_eq!(parsed, (first <= last).then_some((first, last)));
        if let Some((a, b)) = parse_copy_range(&garbage) {
            prop_assert!(a <= b);
        }
    }

    // Conditional requests follow RFC 7232's precedence for any combination of headers.
    #[test]
    fn conditional_evaluation(
        etag in "[a-f0-9]{4}",
        if_match in proptest::option::of(proptest::option::of("[a-f0-9]{4}")),
        if_none_match in proptest::option::of(proptest::option::of("[a-f0-9]{4}")),
        modified_s in 0i64..1000,
        if_modified_since in proptest::option::of(0i64..1000),
        if_unmodified_since in proptest::option::of(0i64..1000),
    ) {
        let conditions = Conditions {
            if_match: if_match.clone(),
            if_none_match: if_none_match.clone(),
            if_modified_since_unix_s: if_modified_since,
            if_unmodified_since_unix_s: if_unmodified_since,
        };
        let result = evaluate(&conditions, &etag, modified_s * 1000 + 999);
        let matches = |c: &Option<String>| c.as_ref().is_none_or(|v| v == &etag);
        let failed = match &if_match {
            Some(c) => !matches(c),
            None => if_unmodified_since.is_some_and(|t| modified_s > t),
        };
        let not_modified = match &if_none_match {
            Some(c) => matches(c),
            None => if_modified_since.is_some_and(|t| modified_s <= t),
        };
        let expected = if failed {
            Precondition::Failed
        } else if not_modified {
            Precondition::NotModified
        } else {
            Precondition::Proceed
        };
        prop_assert_eq!(result, expected);
    }
}
