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
        proptest::collection::vec(("[a-z]{1,8}", ".{0,16}"), 0..4),
    )
        .prop_map(
            |(content, etag, modified_unix_ms, metadata, content_type, tags)| {
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
                    tags,
                    version_seq: modified_unix_ms.unsigned_abs(),
                    versioned: modified_unix_ms % 2 == 0,
                    delete_marker: false,
                    lock: Default::default(),
                    public_read: false,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

    // Bucket names built to S3's rules (dot-separated labels of letters, digits and inner
    // hyphens, 3..=63 bytes, not an IP address) are accepted; one character outside the
    // alphabet, or a length outside 3..=63, makes any of them refused.
    #[test]
    fn bucket_names_built_by_the_rules_are_accepted(
        labels in proptest::collection::vec("[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", 1..6),
        bad in "[A-Z_ /!@#%]",
        position in any::<usize>(),
    ) {
        let name = labels.join(".");
        prop_assume!((3..=63).contains(&name.len()));
        prop_assume!(name.parse::<std::net::Ipv4Addr>().is_err());
        prop_assume!(!name.starts_with("xn--"));
        prop_assert!(validate_bucket_name(&name).is_ok(), "{} refused", name);
        let at = position % (name.len() + 1);
        let broken = format!("{}{}{}", &name[..at], bad, &name[at..]);
        prop_assert!(validate_bucket_name(&broken).is_err(), "{} accepted", broken);
        let long = format!("{name}{}", "a".repeat(64 - name.len()));
        prop_assert!(validate_bucket_name(&long).is_err(), "{} accepted", long);
    }

    // Any string: validation never panics, and what it accepts obeys the rules.
    #[test]
    fn bucket_name_validation_of_anything(name in ".{0,70}") {
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
        let bytes = records::encode_manifest(&manifest);
        prop_assert_eq!(records::decode_manifest(&bytes).unwrap(), manifest);
    }

    // Arbitrary bytes, mutated and truncated manifests never panic the decoder; whatever
    // decodes re-encodes to bytes that decode to the same manifest; a strict prefix of an
    // encoding never decodes to the original.
    #[test]
    fn manifest_decode_garbage(
        manifest in manifest_strategy(),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        garbage in proptest::collection::vec(any::<u8>(), 0..200),
        cut in any::<usize>(),
    ) {
        let _ = records::decode_manifest(&garbage);
        let encoded = records::encode_manifest(&manifest);
        let mut bytes = encoded.clone();
        for (position, value) in flips {
            let index = position % bytes.len();
            bytes[index] ^= value;
        }
        if let Ok(decoded) = records::decode_manifest(&bytes) {
            let again = records::decode_manifest(&records::encode_manifest(&decoded)).unwrap();
            prop_assert_eq!(again, decoded);
        }
        let prefix = &encoded[..cut % encoded.len()];
        prop_assert_ne!(records::decode_manifest(prefix).ok(), Some(manifest));
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

    // Conditional requests follow RFC 7232 section 6, checked by its consequences rather than a
    // second copy of the algorithm: a failed If-Match fails whatever else is sent; If-Match
    // (present) makes If-Unmodified-Since irrelevant, and If-None-Match makes
    // If-Modified-Since irrelevant; with no headers the request proceeds.
    #[test]
    fn conditional_evaluation(
        etag in "[a-f0-9]{4}",
        other in "[a-f0-9]{4}",
        if_none_match in proptest::option::of(proptest::option::of("[a-f0-9]{4}")),
        modified_s in 0i64..1000,
        if_modified_since in proptest::option::of(0i64..1000),
        if_unmodified_since in proptest::option::of(0i64..1000),
    ) {
        prop_assume!(other != etag);
        let modified_ms = modified_s * 1000 + 999;
        let eval = |if_match: Option<Option<String>>,
                    if_none_match: Option<Option<String>>,
                    if_modified_since_unix_s: Option<i64>,
                    if_unmodified_since_unix_s: Option<i64>| {
            evaluate(
                &Conditions { if_match, if_none_match, if_modified_since_unix_s, if_unmodified_since_unix_s },
                &etag,
                modified_ms,
            )
        };
        prop_assert_eq!(eval(None, None, None, None), Precondition::Proceed);
        prop_assert_eq!(
            eval(Some(Some(other.clone())), if_none_match.clone(), if_modified_since, if_unmodified_since),
            Precondition::Failed
        );
        for if_match in [Some(Some(etag.clone())), Some(None)] {
            prop_assert_eq!(
                eval(if_match.clone(), if_none_match.clone(), if_modified_since, if_unmodified_since),
                eval(if_match.clone(), if_none_match.clone(), if_modified_since, None)
            );
        }
        if if_none_match.is_some() {
            prop_assert_eq!(
                eval(None, if_none_match.clone(), if_modified_since, None),
                eval(None, if_none_match.clone(), None, None)
            );
        }
        prop_assert_eq!(eval(None, Some(Some(etag.clone())), None, None), Precondition::NotModified);
        prop_assert_eq!(eval(None, Some(None), None, None), Precondition::NotModified);
        prop_assert_eq!(eval(None, Some(Some(other.clone())), None, None), Precondition::Proceed);
        prop_assert_eq!(
            eval(None, None, None, Some(modified_s - 1)),
            Precondition::Failed,
            "modified after If-Unmodified-Since"
        );
        prop_assert_eq!(eval(None, None, None, Some(modified_s)), Precondition::Proceed);
        prop_assert_eq!(eval(None, None, Some(modified_s), None), Precondition::NotModified);
        prop_assert_eq!(eval(None, None, Some(modified_s - 1), None), Precondition::Proceed);
        // Quoted etags compare as their value.
        prop_assert_eq!(eval(Some(Some(format!("\"{etag}\""))), None, None, None), Precondition::Proceed);
    }
}
