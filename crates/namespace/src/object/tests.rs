//! Object-layer tests on a real store (under `target/test-data/`, a real filesystem): manifests,
//! refcounts and chunk freeing, listing with prefix/delimiter/continuation, multipart assembly,
//! bucket and key administration, garbage collection.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;

use keel_store::{chunk_key, Compression, Store, StoreConfig};
use md5::{Digest, Md5};

use super::list::{ListRequest, ListStart};
use super::multipart::PART_SIZE_MIN_BYTES;
use super::records::{self, Content, Manifest, PartRecord, UploadRecord};
use super::*;

/// A data directory under `target/test-data/` (a real filesystem), removed when the test passes
/// (kept for inspection when it fails).
struct TestDir(PathBuf);

impl std::ops::Deref for TestDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn test_dir(name: &str) -> TestDir {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/test-data")
        .join(format!("object-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    TestDir(dir)
}

fn open(dir: &std::path::Path) -> Arc<Objects> {
    open_on(dir, Arc::new(keel_clock::SystemClock))
}

fn open_on(dir: &std::path::Path, clock: Arc<dyn keel_clock::Clock>) -> Arc<Objects> {
    let store = Store::open(StoreConfig::new(vec![dir.to_path_buf()])).unwrap();
    let metadata: Arc<dyn keel_catalog::Metadata> =
        Arc::new(keel_catalog::LocalCatalog::open(store.clone()).unwrap());
    let chunks = Arc::new(LocalChunkStore::new(store.clone()));
    Objects::open_with_clock(store, metadata, chunks, clock).unwrap()
}

fn with_bucket(name: &str) -> (TestDir, Arc<Objects>) {
    with_bucket_on(name, Arc::new(keel_clock::SystemClock))
}

fn with_bucket_on(name: &str, clock: Arc<dyn keel_clock::Clock>) -> (TestDir, Arc<Objects>) {
    let dir = test_dir(name);
    let objects = open_on(&dir, clock);
    objects
        .add_key(KeyRecord {
            access_key_id: "OWNER".into(),
            name: "owner".into(),
            secret_access_key: "secretsecret".into(),
            created_unix_ms: 0,
        })
        .unwrap();
    objects
        .create_bucket("bucket", "OWNER", Compression::Zstd)
        .unwrap();
    (dir, objects)
}

/// Writes `data` the way the frontend does: chunks first, then the manifest.
fn put(objects: &Objects, bucket: &str, key: &str, data: &[u8]) -> Manifest {
    let mut pins = objects.pin_set();
    let content = if data.len() <= INLINE_SIZE_MAX_BYTES {
        Content::Inline(data.to_vec())
    } else {
        Content::Chunks(
            data.chunks(CHUNK_SIZE_BYTES)
                .map(|c| {
                    objects
                        .write_chunk(Compression::Zstd, c.to_vec(), &mut pins)
                        .unwrap()
                })
                .collect(),
        )
    };
    let manifest = Manifest {
        size_bytes: data.len() as u64,
        etag: hex::encode(Md5::digest(data)),
        modified_unix_ms: now_unix_ms(),
        content,
        part_sizes_bytes: Vec::new(),
        headers: StoredHeaders::default(),
        metadata: vec![("color".into(), "blue".into())],
        checksums: Checksums::default(),
        tags: Vec::new(),
        version_seq: 0,
        versioned: false,
        delete_marker: false,
        lock: Default::default(),
        public_read: false,
    };
    // As stored: with the version it got.
    objects
        .put_object(bucket, key, manifest, &PutCondition::default())
        .unwrap()
        .0
}

fn read(objects: &Objects, bucket: &str, key: &str) -> Vec<u8> {
    read_version(objects, bucket, key, None)
}

fn read_version(objects: &Objects, bucket: &str, key: &str, version: Option<&str>) -> Vec<u8> {
    let version = version.map(|id| VersionId::parse(id).unwrap());
    let manifest = objects.get_manifest(bucket, key, version).unwrap();
    match &manifest.content {
        Content::Inline(data) => data.clone(),
        Content::Chunks(chunks) => chunks
            .iter()
            .flat_map(|c| objects.read_chunk(c).unwrap())
            .collect(),
    }
}

fn refcount(objects: &Objects, hash: &[u8; 32]) -> u64 {
    objects
        .store()
        .get(&records::refcount_key(hash))
        .unwrap()
        .map(|v| records::decode_refcount(&v).unwrap())
        .unwrap_or(0)
}

fn pattern(size: usize, seed: u8) -> Vec<u8> {
    (0..size)
        .map(|i| {
            (i as u8).wrapping_mul(31).wrapping_add(seed)
                ^ ((i >> 12) as u8)
                ^ ((i >> 20) as u8).wrapping_mul(7)
        })
        .collect()
}

// Proves inline and chunked objects read back byte for byte, with their metadata, across a
// reopen of the store (the manifest and chunks are durable records, not memory).
#[test]
fn objects_round_trip_and_survive_reopen() {
    let (dir, objects) = with_bucket("round-trip");
    let small = b"hello".to_vec();
    let large = pattern(3 * CHUNK_SIZE_BYTES + 12345, 7);
    put(&objects, "bucket", "small", &small);
    let manifest = put(&objects, "bucket", "dir/large", &large);
    assert_eq!(manifest.content.chunk_refs().len(), 4);
    drop(objects);
    let objects = open(&dir);
    assert_eq!(read(&objects, "bucket", "small"), small);
    assert_eq!(read(&objects, "bucket", "dir/large"), large);
    let manifest = objects.get_manifest("bucket", "dir/large", None).unwrap();
    assert_eq!(manifest.metadata, vec![("color".into(), "blue".into())]);
    assert!(matches!(
        objects.get_manifest("bucket", "missing", None),
        Err(ObjectError::NoSuchKey { .. })
    ));
    assert!(matches!(
        objects.get_manifest("nobucket", "x", None),
        Err(ObjectError::NoSuchBucket(_))
    ));
}

// Proves refcounts count every use of a chunk: identical objects share chunks, and a chunk is
// deleted from the store exactly when the last object using it is deleted or overwritten.
#[test]
fn refcounts_free_chunks_when_last_reference_goes() {
    let (_dir, objects) = with_bucket("refcounts");
    let data = pattern(2 * CHUNK_SIZE_BYTES, 1);
    let first = put(&objects, "bucket", "a", &data);
    put(&objects, "bucket", "b", &data);
    let hashes: Vec<[u8; 32]> = first.content.chunk_refs().iter().map(|c| c.hash).collect();
    for hash in &hashes {
        assert_eq!(refcount(&objects, hash), 2);
    }
    objects.delete_object("bucket", "a", None, false).unwrap();
    for hash in &hashes {
        assert_eq!(refcount(&objects, hash), 1);
        assert!(objects.store().contains(&chunk_key(hash)).unwrap());
    }
    assert_eq!(read(&objects, "bucket", "b"), data);
    // Overwriting the last user with other bytes frees the old chunks.
    put(&objects, "bucket", "b", &pattern(2 * CHUNK_SIZE_BYTES, 2));
    for hash in &hashes {
        assert_eq!(refcount(&objects, hash), 0);
        assert!(!objects.store().contains(&chunk_key(hash)).unwrap());
    }
    objects.delete_object("bucket", "a", None, false).unwrap();
    // An object that repeats one chunk counts it twice.
    let repeated: Vec<u8> = [pattern(CHUNK_SIZE_BYTES, 9), pattern(CHUNK_SIZE_BYTES, 9)].concat();
    let manifest = put(&objects, "bucket", "twice", &repeated);
    let hash = manifest.content.chunk_refs()[0].hash;
    assert_eq!(refcount(&objects, &hash), 2);
    objects
        .delete_object("bucket", "twice", None, false)
        .unwrap();
    assert!(!objects.store().contains(&chunk_key(&hash)).unwrap());
}

// Proves a conditional delete (the lifecycle worker's) deletes only the object it looked at:
// one written again since (another modification time) stays, with its chunks.
#[test]
fn a_conditional_delete_spares_an_object_written_again() {
    let (_dir, objects) = with_bucket("conditional_delete");
    let seen = put(&objects, "bucket", "log", b"old");
    std::thread::sleep(std::time::Duration::from_millis(5));
    let newer = put(&objects, "bucket", "log", b"new");
    assert_ne!(seen.modified_unix_ms, newer.modified_unix_ms);
    let deleted = objects
        .delete_object_if("bucket", "log", |m| {
            m.modified_unix_ms == seen.modified_unix_ms
        })
        .unwrap();
    assert!(!deleted);
    assert_eq!(read(&objects, "bucket", "log"), b"new");
    let deleted = objects
        .delete_object_if("bucket", "log", |m| {
            m.modified_unix_ms == newer.modified_unix_ms
        })
        .unwrap();
    assert!(deleted);
    assert!(objects.get_manifest("bucket", "log", None).is_err());
}

fn list_all(
    objects: &Objects,
    prefix: &str,
    delimiter: Option<&str>,
    page: usize,
) -> (Vec<String>, Vec<String>, usize) {
    let mut keys = Vec::new();
    let mut prefixes = Vec::new();
    let mut start: Option<ListStart> = None;
    let mut pages = 0;
    loop {
        let result = objects
            .list_objects(
                "bucket",
                &ListRequest {
                    prefix: prefix.into(),
                    delimiter: delimiter.map(str::to_string),
                    start: start.clone(),
                    max_entries: page,
                },
            )
            .unwrap();
        pages += 1;
        assert!(result.entries.len() + result.common_prefixes.len() <= page);
        keys.extend(result.entries.into_iter().map(|e| e.key));
        prefixes.extend(result.common_prefixes);
        if !result.truncated {
            break;
        }
        start = result.next;
        assert!(start.is_some(), "a truncated page says where to continue");
        assert!(pages < 1000);
    }
    (keys, prefixes, pages)
}

// Proves listing follows S3: keys in byte order, prefix filtering, delimiter roll-up into common
// prefixes, and that paging with any page size returns the same set exactly once.
#[test]
fn listing_prefix_delimiter_and_continuation() {
    let (_dir, objects) = with_bucket("listing");
    let names = [
        "a/1", "a/2", "a/b/3", "b", "b/1", "c", "d/e/f", "d/e/g", "..", "../x", "z z", "é",
    ];
    for name in names {
        put(&objects, "bucket", name, name.as_bytes());
    }
    let mut sorted: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    sorted.sort();
    for page in [1, 2, 3, 1000] {
        let (keys, prefixes, _) = list_all(&objects, "", None, page);
        assert_eq!(keys, sorted, "page size {page}");
        assert!(prefixes.is_empty());
        let (keys, prefixes, _) = list_all(&objects, "", Some("/"), page);
        assert_eq!(keys, vec!["..", "b", "c", "z z", "é"], "page size {page}");
        assert_eq!(prefixes, vec!["../", "a/", "b/", "d/"], "page size {page}");
        let (keys, prefixes, _) = list_all(&objects, "a/", Some("/"), page);
        assert_eq!(keys, vec!["a/1", "a/2"]);
        assert_eq!(prefixes, vec!["a/b/"]);
        let (keys, _, _) = list_all(&objects, "d/", None, page);
        assert_eq!(keys, vec!["d/e/f", "d/e/g"]);
    }
    let (keys, _, _) = list_all(&objects, "nothing", Some("/"), 10);
    assert!(keys.is_empty());
    // Start after a key (V1 marker / V2 start-after).
    let result = objects
        .list_objects(
            "bucket",
            &ListRequest {
                start: Some(ListStart::AfterKey("c".into())),
                max_entries: 1000,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(result.entries[0].key, "d/e/f");
}

fn upload_part(objects: &Objects, upload_id: &str, number: u32, data: &[u8]) -> String {
    let mut pins = objects.pin_set();
    let chunks = data
        .chunks(CHUNK_SIZE_BYTES)
        .map(|c| {
            objects
                .write_chunk(Compression::Lz4, c.to_vec(), &mut pins)
                .unwrap()
        })
        .collect();
    let etag = hex::encode(Md5::digest(data));
    objects
        .commit_part(
            "bucket",
            "multi",
            upload_id,
            &PartRecord {
                part_number: number,
                size_bytes: data.len() as u64,
                etag: etag.clone(),
                modified_unix_ms: now_unix_ms(),
                chunks,
                checksums: Checksums::default(),
            },
        )
        .unwrap();
    etag
}

fn start_upload(objects: &Objects, upload_id: &str) {
    objects
        .create_upload(
            "bucket",
            &UploadRecord {
                key: "multi".into(),
                upload_id: upload_id.into(),
                initiated_unix_ms: now_unix_ms(),
                headers: StoredHeaders {
                    content_type: Some("application/x-test".into()),
                    ..Default::default()
                },
                metadata: Vec::new(),
                checksum_algorithm: None,
                tags: vec![("stage".into(), "upload".into())],
                lock: Lock::default(),
                public_read: false,
            },
        )
        .unwrap();
}

// Proves multipart completion: parts are validated (order, ETag, 5 MiB minimum), assembled in
// order into one manifest with the `-N` ETag, parts left out are freed, and abort frees all.
#[test]
fn multipart_assembly_and_validation() {
    let (_dir, objects) = with_bucket("multipart");
    start_upload(&objects, "u1");
    let one = pattern(PART_SIZE_MIN_BYTES as usize, 1);
    let two = pattern(1000, 2);
    let unused = pattern(PART_SIZE_MIN_BYTES as usize + 7, 3);
    let etag1 = upload_part(&objects, "u1", 1, &one);
    let etag2 = upload_part(&objects, "u1", 2, &two);
    let etag3 = upload_part(&objects, "u1", 3, &unused);
    let condition = PutCondition::default();
    let order = objects.complete_upload(
        "bucket",
        "multi",
        "u1",
        &[(2, etag2.clone()), (1, etag1.clone())],
        &condition,
    );
    assert!(matches!(order, Err(ObjectError::InvalidPartOrder)));
    let wrong = objects.complete_upload("bucket", "multi", "u1", &[(1, etag2.clone())], &condition);
    assert!(matches!(wrong, Err(ObjectError::InvalidPart { .. })));
    let missing =
        objects.complete_upload("bucket", "multi", "u1", &[(9, etag2.clone())], &condition);
    assert!(matches!(missing, Err(ObjectError::InvalidPart { .. })));
    let small = objects.complete_upload(
        "bucket",
        "multi",
        "u1",
        &[(2, etag2.clone()), (3, etag3.clone())],
        &condition,
    );
    assert!(matches!(small, Err(ObjectError::EntityTooSmall { .. })));
    let (parts, truncated) = objects.list_parts("bucket", "multi", "u1", 0, 2).unwrap();
    assert_eq!(parts.len(), 2);
    assert!(truncated);
    let (uploads, _) = objects.list_uploads_page("bucket", "", None, 10).unwrap();
    assert_eq!(uploads.len(), 1);

    let unused_hashes: Vec<[u8; 32]> = objects
        .list_parts("bucket", "multi", "u1", 2, 10)
        .unwrap()
        .0[0]
        .chunks
        .iter()
        .map(|c| c.hash)
        .collect();
    let manifest = objects
        .complete_upload(
            "bucket",
            "multi",
            "u1",
            &[(1, format!("\"{etag1}\"")), (2, etag2.clone())],
            &condition,
        )
        .unwrap()
        .0;
    assert_eq!(manifest.size_bytes, (one.len() + two.len()) as u64);
    assert!(manifest.etag.ends_with("-2"));
    assert_eq!(
        manifest.etag,
        multipart::multipart_etag(&[&etag1, &etag2]).unwrap()
    );
    assert_eq!(
        manifest.headers.content_type.as_deref(),
        Some("application/x-test")
    );
    assert_eq!(read(&objects, "bucket", "multi"), [one, two].concat());
    for hash in &unused_hashes {
        assert!(!objects.store().contains(&chunk_key(hash)).unwrap());
    }
    assert!(matches!(
        objects.get_upload("bucket", "multi", "u1"),
        Err(ObjectError::NoSuchUpload(_))
    ));
    // A client retrying Complete (after a timeout) gets the same object back, nothing changes;
    // another part list for the finished upload is still refused.
    let again = objects
        .complete_upload(
            "bucket",
            "multi",
            "u1",
            &[(1, etag1.clone()), (2, etag2.clone())],
            &condition,
        )
        .unwrap()
        .0;
    assert_eq!(
        (again.etag.as_str(), again.modified_unix_ms),
        (manifest.etag.as_str(), manifest.modified_unix_ms)
    );
    let other = objects.complete_upload("bucket", "multi", "u1", &[(1, etag1.clone())], &condition);
    assert!(matches!(other, Err(ObjectError::NoSuchUpload(_))));
    assert!(objects
        .list_uploads_page("bucket", "", None, 10)
        .unwrap()
        .0
        .is_empty());

    start_upload(&objects, "u2");
    let data = pattern(CHUNK_SIZE_BYTES + 5, 4);
    upload_part(&objects, "u2", 1, &data);
    let hashes: Vec<[u8; 32]> = data
        .chunks(CHUNK_SIZE_BYTES)
        .map(|c| *blake3::hash(c).as_bytes())
        .collect();
    objects.abort_upload("bucket", "multi", "u2").unwrap();
    for hash in &hashes {
        assert!(!objects.store().contains(&chunk_key(hash)).unwrap());
    }
}

// Proves bucket administration: ownership errors, BucketNotEmpty, grants, name validation and
// that buckets and keys come back after a reopen.
#[test]
fn buckets_and_keys() {
    let (dir, objects) = with_bucket("buckets");
    objects
        .add_key(KeyRecord {
            access_key_id: "OTHER".into(),
            name: "other".into(),
            secret_access_key: "secretsecret".into(),
            created_unix_ms: 0,
        })
        .unwrap();
    assert!(matches!(
        objects.create_bucket("bucket", "OWNER", Compression::None),
        Err(ObjectError::BucketAlreadyOwnedByYou(_))
    ));
    assert!(matches!(
        objects.create_bucket("bucket", "OTHER", Compression::None),
        Err(ObjectError::BucketAlreadyExists(_))
    ));
    assert!(matches!(
        objects.create_bucket("Bad_Name", "OWNER", Compression::None),
        Err(ObjectError::InvalidBucketName { .. })
    ));
    assert_eq!(objects.can_access("bucket", "OTHER"), Some(false));
    assert_eq!(objects.can_access("nothing", "OTHER"), None);
    objects.allow("bucket", "OTHER").unwrap();
    assert_eq!(objects.can_access("bucket", "OTHER"), Some(true));
    assert_eq!(objects.list_buckets_for("OTHER").len(), 1);
    put(&objects, "bucket", "k", b"x");
    assert!(matches!(
        objects.delete_bucket("bucket"),
        Err(ObjectError::BucketNotEmpty(_))
    ));
    let info = objects.bucket_info("bucket").unwrap();
    assert_eq!((info.objects, info.logical_bytes), (1, 1));
    drop(objects);
    let objects = open(&dir);
    assert_eq!(objects.can_access("bucket", "OTHER"), Some(true));
    assert_eq!(objects.list_keys().len(), 2);
    objects.delete_object("bucket", "k", None, false).unwrap();
    objects.delete_bucket("bucket").unwrap();
    assert!(objects.bucket("bucket").is_none());
    objects.delete_key("OTHER").unwrap();
    assert!(matches!(
        objects.delete_key("OTHER"),
        Err(ObjectError::NoSuchAccessKey(_))
    ));
}

// Proves conditional PUT: If-None-Match: * refuses to replace an existing object.
#[test]
fn put_if_none_match() {
    let (_dir, objects) = with_bucket("conditional");
    put(&objects, "bucket", "k", b"one");
    let manifest = objects.get_manifest("bucket", "k", None).unwrap();
    let refused = objects.put_object(
        "bucket",
        "k",
        manifest.clone(),
        &PutCondition {
            if_none_match_any: true,
            if_match_etag: None,
        },
    );
    assert!(matches!(refused, Err(ObjectError::PreconditionFailed(_))));
}

// Proves garbage collection frees a chunk whose upload never committed, and keeps chunks that
// are referenced or pinned by an upload in progress.
#[test]
fn garbage_collection_frees_only_orphans() {
    let (_dir, objects) = with_bucket("gc");
    let kept = put(
        &objects,
        "bucket",
        "kept",
        &pattern(CHUNK_SIZE_BYTES + 1, 5),
    );
    // What a crash between a chunk write and its manifest leaves: a chunk nobody references
    // (a failed upload that is still running frees its own chunks when it gives up).
    let orphan_data = pattern(1000, 6);
    let orphan = ChunkRef {
        hash: *blake3::hash(&orphan_data).as_bytes(),
        length_bytes: orphan_data.len() as u32,
    };
    LocalChunkStore::new(objects.store().clone())
        .put_chunk(&orphan.hash, orphan_data, Compression::Zstd)
        .unwrap();
    let mut pins = objects.pin_set();
    let pinned = objects
        .write_chunk(Compression::Zstd, pattern(2000, 7), &mut pins)
        .unwrap();
    let report = objects.collect_garbage().unwrap();
    assert_eq!(report.chunks_deleted, 1);
    assert!(!objects.store().contains(&chunk_key(&orphan.hash)).unwrap());
    assert!(objects.store().contains(&chunk_key(&pinned.hash)).unwrap());
    for chunk in kept.content.chunk_refs() {
        assert!(objects.store().contains(&chunk_key(&chunk.hash)).unwrap());
    }
    drop(pins);
}

// Proves manifests and upload records written before tags existed (version 1: the same
// fields in the same order, no tags) still decode, with no tags; tags then round-trip through
// set_object_tags, which leaves the rest of the object as it was.
#[test]
fn version_one_records_decode_and_tags_are_set_in_place() {
    let headers = StoredHeaders {
        content_type: Some("text/plain".into()),
        ..Default::default()
    };
    let v1_manifest = (
        3u64,
        "etag".to_string(),
        7i64,
        Content::Inline(vec![1, 2, 3]),
        Vec::<u64>::new(),
        headers.clone(),
        vec![("a".to_string(), "b".to_string())],
        Checksums::default(),
    );
    let mut bytes = vec![records::RECORD_VERSION];
    bytes.extend(postcard::to_allocvec(&v1_manifest).unwrap());
    let manifest = records::decode_manifest(&bytes).unwrap();
    assert_eq!((manifest.size_bytes, manifest.modified_unix_ms), (3, 7));
    assert_eq!(manifest.headers, headers);
    assert!(manifest.tags.is_empty());
    // Version 2 (tags, no version): the `null` version, ordered by its modification time.
    let v2_manifest = (
        3u64,
        "etag".to_string(),
        7i64,
        Content::Inline(vec![1, 2, 3]),
        Vec::<u64>::new(),
        headers.clone(),
        Vec::<(String, String)>::new(),
        Checksums::default(),
        vec![("t".to_string(), "v".to_string())],
    );
    let mut bytes = vec![records::TAGGED_RECORD_VERSION];
    bytes.extend(postcard::to_allocvec(&v2_manifest).unwrap());
    let manifest = records::decode_manifest(&bytes).unwrap();
    assert_eq!(manifest.tags.len(), 1);
    assert_eq!((manifest.version_seq, manifest.versioned), (7000, false));
    assert_eq!(manifest.version_id(), "null");

    let v1_upload = (
        "key".to_string(),
        "upload".to_string(),
        9i64,
        headers.clone(),
        Vec::<(String, String)>::new(),
        Some("CRC32C".to_string()),
    );
    let mut bytes = vec![records::RECORD_VERSION];
    bytes.extend(postcard::to_allocvec(&v1_upload).unwrap());
    let upload = records::decode_upload(&bytes).unwrap();
    assert_eq!(upload.checksum_algorithm.as_deref(), Some("CRC32C"));
    assert!(upload.tags.is_empty());

    let (_dir, objects) = with_bucket("tags-in-place");
    let written = put(&objects, "bucket", "tagged", b"tagged bytes");
    let tags = vec![("project".to_string(), "keel".to_string())];
    objects
        .set_object_tags("bucket", "tagged", None, tags.clone())
        .unwrap();
    let read = objects.get_manifest("bucket", "tagged", None).unwrap();
    assert_eq!(read.tags, tags);
    assert_eq!(
        read,
        Manifest {
            tags,
            version_seq: read.version_seq,
            ..written
        }
    );
    let eleven: Tags = (0..11).map(|i| (format!("k{i}"), String::new())).collect();
    assert!(matches!(
        objects.set_object_tags("bucket", "tagged", None, eleven),
        Err(ObjectError::InvalidTag(_))
    ));
    let twice = vec![
        ("k".to_string(), "1".to_string()),
        ("k".to_string(), "2".to_string()),
    ];
    assert!(matches!(
        objects.set_object_tags("bucket", "tagged", None, twice),
        Err(ObjectError::InvalidTag(_))
    ));
    assert!(matches!(
        objects.set_object_tags("bucket", "absent", None, Vec::new()),
        Err(ObjectError::NoSuchKey { .. })
    ));
}

// Proves decoders refuse garbage with an error instead of panicking or misreading.
#[test]
fn corrupt_records_are_errors() {
    assert!(records::decode_manifest(&[]).is_err());
    assert!(records::decode_manifest(&[9, 1, 2, 3]).is_err());
    assert!(records::decode_manifest(&[records::RECORD_VERSION, 0xff, 0xff]).is_err());
    let mut manifest = Manifest {
        size_bytes: 10,
        etag: "x".into(),
        modified_unix_ms: 0,
        content: Content::Inline(vec![1, 2, 3]),
        part_sizes_bytes: Vec::new(),
        headers: StoredHeaders::default(),
        metadata: Vec::new(),
        checksums: Checksums::default(),
        tags: vec![("k".into(), "v".into())],
        version_seq: 7,
        versioned: true,
        delete_marker: false,
        lock: Default::default(),
        public_read: false,
    };
    // Size disagrees with content: refused.
    assert!(records::decode_manifest(&records::encode_manifest(&manifest)).is_err());
    manifest.size_bytes = 3;
    assert_eq!(
        records::decode_manifest(&records::encode_manifest(&manifest)).unwrap(),
        manifest
    );
    assert!(records::decode_refcount(&[1, 2, 3]).is_err());
}

// Proves key validation: NUL and over-long keys are refused; `..` and slashes are plain keys.
#[test]
fn key_validation() {
    assert!(validate_object_key("..").is_ok());
    assert!(validate_object_key("../../etc/passwd").is_ok());
    assert!(validate_object_key(&"k".repeat(KEY_LENGTH_MAX_BYTES)).is_ok());
    assert!(matches!(
        validate_object_key(&"k".repeat(KEY_LENGTH_MAX_BYTES + 1)),
        Err(ObjectError::KeyTooLong)
    ));
    assert!(matches!(
        validate_object_key("a\0b"),
        Err(ObjectError::InvalidArgument(_))
    ));
    assert!(validate_object_key("").is_err());
    assert!(validate_bucket_name("my-bucket.1").is_ok());
    for bad in [
        "ab",
        "UPPER",
        "a..b",
        "-ab",
        "ab-",
        "192.168.1.1",
        "xn--ab",
        "a_b",
    ] {
        assert!(validate_bucket_name(bad).is_err(), "{bad}");
    }
}

// Proves refcounts stay exact under concurrency: threads writing, overwriting and deleting
// objects that share chunks leave every chunk counted correctly, and once everything is deleted
// no refcount record and no chunk remains.
#[test]
fn concurrent_writers_keep_refcounts_exact() {
    let (_dir, objects) = with_bucket("concurrent");
    let shared = pattern(2 * CHUNK_SIZE_BYTES, 11);
    let hashes: Vec<[u8; 32]> = shared
        .chunks(CHUNK_SIZE_BYTES)
        .map(|c| *blake3::hash(c).as_bytes())
        .collect();
    std::thread::scope(|scope| {
        for thread in 0..6 {
            let objects = &objects;
            let shared = &shared;
            scope.spawn(move || {
                for round in 0..5 {
                    let key = format!("t{thread}/{round}");
                    put(objects, "bucket", &key, shared);
                    // Everyone also fights over one key.
                    put(objects, "bucket", "contended", shared);
                    if round % 2 == 0 {
                        objects.delete_object("bucket", &key, None, false).unwrap();
                    }
                }
            });
        }
    });
    let live = objects
        .list_objects(
            "bucket",
            &ListRequest {
                max_entries: 1000,
                ..Default::default()
            },
        )
        .unwrap()
        .entries
        .len() as u64;
    // Each live object holds one reference to each of the two distinct chunks.
    for hash in &hashes {
        assert_eq!(refcount(&objects, hash), live);
    }
    let keys: Vec<String> = objects
        .list_objects(
            "bucket",
            &ListRequest {
                max_entries: 1000,
                ..Default::default()
            },
        )
        .unwrap()
        .entries
        .into_iter()
        .map(|e| e.key)
        .collect();
    for key in keys {
        objects.delete_object("bucket", &key, None, false).unwrap();
    }
    for hash in &hashes {
        assert_eq!(refcount(&objects, hash), 0);
        assert!(!objects.store().contains(&chunk_key(hash)).unwrap());
    }
}

// Proves the inline-bytes encoding is postcard's encoding of a plain `Vec<u8>` (so records
// written either way decode the same).
#[test]
fn inline_bytes_encoding_is_postcard_seq_of_u8() {
    let data: Vec<u8> = (0..300u32).map(|i| (i * 7) as u8).collect();
    let plain = postcard::to_allocvec(&data).unwrap();
    let ours = postcard::to_allocvec(&Content::Inline(data.clone())).unwrap();
    // Enum variant index 0, then the same bytes as the plain vector.
    assert_eq!(ours[0], 0);
    assert_eq!(&ours[1..], &plain[..]);
    let back: Content = postcard::from_bytes(&ours).unwrap();
    assert_eq!(back, Content::Inline(data));
}

// Proves a failed upload frees its chunks when it gives up (issue 10, defect 7): chunks written
// under a pin set that is dropped without a commit are deleted at once, unless a committed
// object references them too.
#[test]
fn a_failed_upload_frees_its_chunks_at_once() {
    let (_dir, objects) = with_bucket("failed-upload");
    let shared = pattern(CHUNK_SIZE_BYTES, 3);
    let kept = put(&objects, "bucket", "kept", &shared);
    let kept_hash = kept.content.chunk_refs()[0].hash;
    let mut pins = objects.pin_set();
    let own = objects
        .write_chunk(Compression::Zstd, pattern(CHUNK_SIZE_BYTES, 4), &mut pins)
        .unwrap();
    let deduplicated = objects
        .write_chunk(Compression::Zstd, shared.clone(), &mut pins)
        .unwrap();
    assert_eq!(deduplicated.hash, kept_hash);
    assert!(objects.store().contains(&chunk_key(&own.hash)).unwrap());
    drop(pins); // the upload failed: no manifest was committed
    assert!(
        !objects.store().contains(&chunk_key(&own.hash)).unwrap(),
        "the failed upload's own chunk is freed without waiting for garbage collection"
    );
    assert!(objects.store().contains(&chunk_key(&kept_hash)).unwrap());
    assert_eq!(read(&objects, "bucket", "kept"), shared);
}

// Proves a reader's pins keep an object's chunks through an overwrite and a delete (issue 10,
// defect 6), and that they are freed when the read ends.
#[test]
fn a_pinned_read_keeps_chunks_through_overwrite_and_delete() {
    let (_dir, objects) = with_bucket("pinned-read");
    let data = pattern(3 * CHUNK_SIZE_BYTES, 5);
    put(&objects, "bucket", "obj", &data);
    let (manifest, pins) = objects.get_manifest_pinned("bucket", "obj", None).unwrap();
    put(&objects, "bucket", "obj", &pattern(CHUNK_SIZE_BYTES, 6));
    objects.delete_object("bucket", "obj", None, false).unwrap();
    let chunks = manifest.content.chunk_refs();
    let read_back: Vec<u8> = chunks
        .iter()
        .flat_map(|c| objects.read_chunk(c).unwrap())
        .collect();
    assert_eq!(read_back, data);
    drop(pins);
    for chunk in chunks {
        assert!(!objects.store().contains(&chunk_key(&chunk.hash)).unwrap());
    }
}

// ---- versioning ----

/// Deletes version `id` of `key` in `bucket` (`bypass`: of a GOVERNANCE retention).
fn delete_version(
    objects: &Objects,
    bucket: &str,
    key: &str,
    id: &str,
    bypass: bool,
) -> Result<Deletion, ObjectError> {
    objects.delete_object(bucket, key, Some(VersionId::parse(id).unwrap()), bypass)
}

fn versions_of(objects: &Objects, prefix: &str) -> Vec<(String, String, bool, bool)> {
    let page = objects
        .list_versions(
            "bucket",
            &VersionListRequest {
                prefix: prefix.into(),
                max_entries: 1000,
                ..Default::default()
            },
        )
        .unwrap();
    assert!(!page.truncated);
    page.entries
        .into_iter()
        .map(|e| (e.key, e.version_id, e.is_latest, e.delete_marker))
        .collect()
}

// Proves an enabled bucket keeps every version readable by id, a plain delete adds a delete
// marker (the key reads as missing, its versions stay), deleting the marker by id brings the
// previous version back, deleting the current version by id promotes the next one, removed
// versions free their chunks, and a bucket holding versions cannot be deleted.
#[test]
fn enabled_versioning_keeps_versions_and_deletes_add_markers() {
    let (_dir, objects) = with_bucket("versions-enabled");
    objects.set_bucket_versioning("bucket", true).unwrap();
    let one = pattern(CHUNK_SIZE_BYTES + 10, 1);
    let two = pattern(CHUNK_SIZE_BYTES + 20, 2);
    let id1 = put(&objects, "bucket", "k", &one).version_id();
    let written = put(&objects, "bucket", "k", &two);
    let id2 = written.version_id();
    assert!(id1 != "null" && id2 != "null" && id1 != id2 && id2 > id1);
    assert_eq!(read(&objects, "bucket", "k"), two);
    assert_eq!(read_version(&objects, "bucket", "k", Some(&id1)), one);
    assert_eq!(read_version(&objects, "bucket", "k", Some(&id2)), two);

    let deletion = objects.delete_object("bucket", "k", None, false).unwrap();
    assert!(deletion.delete_marker);
    let marker = deletion.version_id.unwrap();
    assert!(matches!(
        objects.get_manifest("bucket", "k", None),
        Err(ObjectError::DeleteMarker { named: false, ref version_id, .. }) if *version_id == marker
    ));
    assert!(matches!(
        objects.get_manifest("bucket", "k", Some(VersionId::parse(&marker).unwrap())),
        Err(ObjectError::DeleteMarker { named: true, .. })
    ));
    assert!(objects
        .list_objects(
            "bucket",
            &ListRequest {
                max_entries: 10,
                ..Default::default()
            }
        )
        .unwrap()
        .entries
        .is_empty());
    assert_eq!(
        versions_of(&objects, ""),
        vec![
            ("k".to_string(), marker.clone(), true, true),
            ("k".to_string(), id2.clone(), false, false),
            ("k".to_string(), id1.clone(), false, false),
        ]
    );
    assert!(matches!(
        objects.delete_bucket("bucket"),
        Err(ObjectError::BucketNotEmpty(_))
    ));

    // Removing the marker undeletes: the newest version is current again.
    let undelete = delete_version(&objects, "bucket", "k", &marker, false).unwrap();
    assert_eq!(
        (undelete.version_id.as_deref(), undelete.delete_marker),
        (Some(marker.as_str()), true)
    );
    assert_eq!(read(&objects, "bucket", "k"), two);
    // Removing the current version by id promotes the previous one and frees its chunks.
    let two_chunks: Vec<[u8; 32]> = written
        .content
        .chunk_refs()
        .iter()
        .map(|c| c.hash)
        .collect();
    delete_version(&objects, "bucket", "k", &id2, false).unwrap();
    assert_eq!(read(&objects, "bucket", "k"), one);
    for hash in &two_chunks {
        assert_eq!(refcount(&objects, hash), 0);
        assert!(!objects.store().contains(&chunk_key(hash)).unwrap());
    }
    assert_eq!(
        versions_of(&objects, ""),
        vec![("k".to_string(), id1.clone(), true, false)]
    );
    // Deleting a version that does not exist changes nothing; a malformed id is refused.
    delete_version(&objects, "bucket", "k", &id2, false).unwrap();
    assert_eq!(read(&objects, "bucket", "k"), one);
    assert!(matches!(
        VersionId::parse("../etc"),
        Err(ObjectError::InvalidVersionId(_))
    ));
    let info = objects.bucket_info("bucket").unwrap();
    assert_eq!(
        (info.versioning, info.objects, info.kept_versions),
        ("enabled", 1, 0)
    );
    objects.delete_object("bucket", "k", None, false).unwrap();
    let info = objects.bucket_info("bucket").unwrap();
    assert_eq!(
        (info.objects, info.kept_versions),
        (0, 2),
        "the version and its marker"
    );
    let marker = versions_of(&objects, "")[0].1.clone();
    delete_version(&objects, "bucket", "k", &marker, false).unwrap();
    delete_version(&objects, "bucket", "k", &id1, false).unwrap();
    assert!(versions_of(&objects, "").is_empty());
    objects.delete_bucket("bucket").unwrap();
}

// Proves the `null` version: an object written before versioning is kept as `null` when
// versioning is enabled; with versioning suspended a write replaces the `null` version (kept
// or current, its chunks freed) and keeps the versions with ids; a delete makes a `null`
// delete marker. Tags and the canned ACL can be set on one version without touching the others.
#[test]
fn suspended_versioning_replaces_only_the_null_version() {
    let (_dir, objects) = with_bucket("versions-suspended");
    let before = pattern(CHUNK_SIZE_BYTES + 1, 3);
    let first = put(&objects, "bucket", "k", &before);
    assert_eq!(first.version_id(), "null");
    objects.set_bucket_versioning("bucket", true).unwrap();
    let id = put(&objects, "bucket", "k", b"enabled").version_id();
    assert_eq!(read_version(&objects, "bucket", "k", Some("null")), before);
    objects
        .set_object_tags(
            "bucket",
            "k",
            Some(VersionId::Null),
            vec![("old".into(), "yes".into())],
        )
        .unwrap();
    assert!(objects
        .get_manifest("bucket", "k", None)
        .unwrap()
        .tags
        .is_empty());
    assert_eq!(
        objects
            .get_manifest("bucket", "k", Some(VersionId::Null))
            .unwrap()
            .tags
            .len(),
        1
    );

    // So can the canned ACL.
    objects
        .set_object_public_read("bucket", "k", Some(VersionId::Null), true)
        .unwrap();
    assert!(objects.object_is_public("bucket", "k", Some(VersionId::Null)));
    assert!(!objects.object_is_public("bucket", "k", None));
    assert!(!objects.object_is_public("bucket", "absent", None));

    objects.set_bucket_versioning("bucket", false).unwrap();
    let replaced = put(&objects, "bucket", "k", b"suspended");
    assert_eq!(replaced.version_id(), "null");
    for chunk in first.content.chunk_refs() {
        assert_eq!(
            refcount(&objects, &chunk.hash),
            0,
            "the old null version is freed"
        );
    }
    assert_eq!(
        versions_of(&objects, ""),
        vec![
            ("k".to_string(), "null".to_string(), true, false),
            ("k".to_string(), id.clone(), false, false),
        ]
    );
    let deletion = objects.delete_object("bucket", "k", None, false).unwrap();
    assert_eq!(
        (deletion.version_id.as_deref(), deletion.delete_marker),
        (Some("null"), true)
    );
    assert_eq!(
        versions_of(&objects, ""),
        vec![
            ("k".to_string(), "null".to_string(), true, true),
            ("k".to_string(), id.clone(), false, false),
        ]
    );
    assert_eq!(read_version(&objects, "bucket", "k", Some(&id)), b"enabled");
}

// Proves ListObjectVersions pages: every version exactly once, in key order and newest first
// within a key, whatever the page size, with only each key's newest marked latest; and a
// delimiter rolls keys up into common prefixes.
#[test]
fn version_listing_pages_and_rolls_up_prefixes() {
    let (_dir, objects) = with_bucket("versions-list");
    objects.set_bucket_versioning("bucket", true).unwrap();
    let mut expected = Vec::new();
    for (key, writes) in [("a", 3), ("b/x", 2), ("b/y", 1), ("ba", 2), ("c", 4)] {
        let mut ids = Vec::new();
        for i in 0..writes {
            ids.push(put(&objects, "bucket", key, format!("{key}{i}").as_bytes()).version_id());
        }
        if key == "ba" {
            let marker = objects.delete_object("bucket", key, None, false).unwrap();
            ids.push(marker.version_id.unwrap());
        }
        for (n, id) in ids.iter().rev().enumerate() {
            expected.push((key.to_string(), id.clone(), n == 0));
        }
    }
    for page_size in [1, 2, 3, 1000] {
        let mut seen = Vec::new();
        let mut request = VersionListRequest {
            max_entries: page_size,
            ..Default::default()
        };
        loop {
            let page = objects.list_versions("bucket", &request).unwrap();
            assert!(page.entries.len() <= page_size);
            seen.extend(
                page.entries
                    .iter()
                    .map(|e| (e.key.clone(), e.version_id.clone(), e.is_latest)),
            );
            if !page.truncated {
                break;
            }
            request.key_marker = page.next_key_marker;
            request.version_id_marker = page.next_version_id_marker;
        }
        assert_eq!(seen, expected, "page size {page_size}");
    }
    let rolled = objects
        .list_versions(
            "bucket",
            &VersionListRequest {
                delimiter: Some("/".into()),
                max_entries: 1000,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(rolled.common_prefixes, vec!["b/".to_string()]);
    let keys: Vec<&str> = rolled.entries.iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, ["a", "a", "a", "ba", "ba", "ba", "c", "c", "c", "c"]);
    let b_only = versions_of(&objects, "b/");
    assert_eq!(b_only.len(), 3);
    // Paging a rolled-up listing one entry at a time lists each prefix once.
    let mut request = VersionListRequest {
        delimiter: Some("/".into()),
        max_entries: 1,
        ..Default::default()
    };
    let (mut paged_keys, mut paged_prefixes) = (Vec::new(), Vec::new());
    for _ in 0..100 {
        let page = objects.list_versions("bucket", &request).unwrap();
        paged_keys.extend(page.entries.iter().map(|e| e.key.clone()));
        paged_prefixes.extend(page.common_prefixes.clone());
        if !page.truncated {
            break;
        }
        request.key_marker = page.next_key_marker;
        request.version_id_marker = page.next_version_id_marker;
    }
    assert_eq!(paged_keys, keys);
    assert_eq!(paged_prefixes, rolled.common_prefixes);
}

fn set_rule(objects: &Objects, rule: keel_catalog::LifecycleRule) {
    objects.set_bucket_lifecycle("bucket", vec![rule]).unwrap();
}

// Proves lifecycle in a versioned bucket: expiring the current version adds a delete marker
// (the data stays as a noncurrent version); a noncurrent version is deleted exactly
// NoncurrentDays after the version that replaced it was written; a delete marker left alone
// is removed, one with versions behind it is not.
#[test]
fn lifecycle_expires_noncurrent_versions_and_lone_delete_markers() {
    const DAY: i64 = 86_400_000;
    let (_dir, objects) = with_bucket("versions-lifecycle");
    objects.set_bucket_versioning("bucket", true).unwrap();
    let old = put(&objects, "bucket", "k", b"old");
    let new = put(&objects, "bucket", "k", b"new");
    set_rule(
        &objects,
        keel_catalog::LifecycleRule {
            enabled: true,
            noncurrent_expiration_days: Some(2),
            ..Default::default()
        },
    );
    let replaced = new.modified_unix_ms;
    let report = objects.apply_lifecycle(replaced + 2 * DAY - 1).unwrap();
    assert_eq!(report.versions_expired, 0);
    assert_eq!(versions_of(&objects, "").len(), 2);
    let report = objects.apply_lifecycle(replaced + 2 * DAY).unwrap();
    assert_eq!(report.versions_expired, 1);
    assert_eq!(
        versions_of(&objects, ""),
        vec![("k".to_string(), new.version_id(), true, false)]
    );
    assert!(matches!(
        objects.get_manifest(
            "bucket",
            "k",
            Some(VersionId::parse(&old.version_id()).unwrap())
        ),
        Err(ObjectError::NoSuchVersion { .. })
    ));

    // Expiring the current version in a versioned bucket adds a delete marker.
    set_rule(
        &objects,
        keel_catalog::LifecycleRule {
            enabled: true,
            expiration_days: Some(1),
            ..Default::default()
        },
    );
    let report = objects.apply_lifecycle(new.modified_unix_ms + DAY).unwrap();
    assert_eq!(report.objects_expired, 1);
    let listed = versions_of(&objects, "");
    assert_eq!(listed.len(), 2);
    assert!(
        listed[0].3 && listed[0].2,
        "a delete marker is the latest: {listed:?}"
    );
    assert_eq!(
        read_version(&objects, "bucket", "k", Some(&new.version_id())),
        b"new"
    );

    // The marker has a version behind it: ExpiredObjectDeleteMarker keeps it...
    set_rule(
        &objects,
        keel_catalog::LifecycleRule {
            enabled: true,
            expired_object_delete_marker: true,
            ..Default::default()
        },
    );
    let later = new.modified_unix_ms + 10 * DAY;
    assert_eq!(
        objects
            .apply_lifecycle(later)
            .unwrap()
            .delete_markers_removed,
        0
    );
    assert_eq!(versions_of(&objects, "").len(), 2);
    // ...until that version is gone.
    objects
        .delete_object(
            "bucket",
            "k",
            Some(VersionId::parse(&new.version_id()).unwrap()),
            false,
        )
        .unwrap();
    assert_eq!(
        objects
            .apply_lifecycle(later)
            .unwrap()
            .delete_markers_removed,
        1
    );
    assert!(versions_of(&objects, "").is_empty());

    // Rules that cannot be applied are refused.
    for bad in [
        keel_catalog::LifecycleRule {
            enabled: true,
            noncurrent_expiration_days: Some(0),
            ..Default::default()
        },
        keel_catalog::LifecycleRule {
            enabled: true,
            expiration_days: Some(3),
            expired_object_delete_marker: true,
            ..Default::default()
        },
    ] {
        assert!(objects.set_bucket_lifecycle("bucket", vec![bad]).is_err());
    }
}

// ---- object lock ----

fn put_locked(
    objects: &Objects,
    key: &str,
    data: &[u8],
    lock: Lock,
) -> Result<String, ObjectError> {
    let manifest = Manifest {
        size_bytes: data.len() as u64,
        etag: hex::encode(Md5::digest(data)),
        modified_unix_ms: objects.wall_unix_ms(),
        content: Content::Inline(data.to_vec()),
        part_sizes_bytes: Vec::new(),
        headers: StoredHeaders::default(),
        metadata: Vec::new(),
        checksums: Checksums::default(),
        tags: Vec::new(),
        version_seq: 0,
        versioned: false,
        delete_marker: false,
        lock,
        public_read: false,
    };
    objects
        .put_object("locked", key, manifest, &PutCondition::default())
        .map(|(_, version)| version.unwrap())
}

fn retention(objects: &Objects, mode: keel_catalog::LockMode, from_now_ms: i64) -> Lock {
    Lock {
        retention: Some(Retention {
            mode,
            until_unix_ms: objects.wall_unix_ms() + from_now_ms,
        }),
        legal_hold: false,
    }
}

// Proves object lock: a GOVERNANCE version is deleted only with the bypass, a COMPLIANCE one
// not at all until its retention ends, a legal hold blocks deletes until lifted, retentions can
// be extended but not shortened, the bucket's default retention applies to new versions, a
// plain DELETE still adds a delete marker, lifecycle leaves locked versions alone, and locks
// are refused on a bucket without object lock and versioning cannot be suspended under it.
#[test]
fn object_lock_protects_versions_until_their_retention_ends() {
    use keel_catalog::LockMode::{Compliance, Governance};
    // Retention runs on the layer's clock: the test moves it instead of waiting.
    let clock = Arc::new(keel_clock::SimClock::new(std::time::SystemTime::now()));
    let (_dir, objects) = with_bucket_on("object-lock", clock.clone());
    objects
        .create_locked_bucket("locked", "OWNER", Compression::None)
        .unwrap();
    assert_eq!(
        objects.versioning("locked"),
        keel_catalog::Versioning::Enabled
    );
    assert!(matches!(
        objects.set_bucket_versioning("locked", false),
        Err(ObjectError::InvalidBucketState { .. })
    ));
    assert!(matches!(
        put_locked(&objects, "x", b"x", retention(&objects, Governance, -1)),
        Err(ObjectError::InvalidArgument(_))
    ));

    let governed = put_locked(
        &objects,
        "g",
        b"governed",
        retention(&objects, Governance, 3_600_000),
    )
    .unwrap();
    assert!(matches!(
        delete_version(&objects, "locked", "g", &governed, false),
        Err(ObjectError::ObjectLocked { .. })
    ));
    // A plain delete adds a marker; the locked version stays.
    assert!(
        objects
            .delete_object("locked", "g", None, false)
            .unwrap()
            .delete_marker
    );
    assert_eq!(
        read_version(&objects, "locked", "g", Some(&governed)),
        b"governed"
    );
    delete_version(&objects, "locked", "g", &governed, true).unwrap();

    let complied = put_locked(
        &objects,
        "c",
        b"complied",
        retention(&objects, Compliance, 400),
    )
    .unwrap();
    let id = Some(VersionId::parse(&complied).unwrap());
    assert!(matches!(
        delete_version(&objects, "locked", "c", &complied, true),
        Err(ObjectError::ObjectLocked { .. })
    ));
    // Shortening or weakening is refused even with the bypass; extending is allowed.
    for weaker in [
        LockChange::Retention(None),
        LockChange::Retention(retention(&objects, Compliance, 100).retention),
        LockChange::Retention(retention(&objects, Governance, 3_600_000).retention),
    ] {
        assert!(matches!(
            objects.set_object_lock("locked", "c", id, weaker, true),
            Err(ObjectError::ObjectLocked { .. })
        ));
    }
    objects
        .set_object_lock(
            "locked",
            "c",
            id,
            LockChange::Retention(retention(&objects, Compliance, 600).retention),
            false,
        )
        .unwrap();
    objects
        .set_object_lock("locked", "c", id, LockChange::LegalHold(true), false)
        .unwrap();
    clock.jump_wall(700);
    // The retention ended; the legal hold still blocks, until it is lifted.
    assert!(matches!(
        delete_version(&objects, "locked", "c", &complied, false),
        Err(ObjectError::ObjectLocked { .. })
    ));
    objects
        .set_object_lock("locked", "c", id, LockChange::LegalHold(false), false)
        .unwrap();
    delete_version(&objects, "locked", "c", &complied, false).unwrap();

    // The default retention applies to versions written without one; lifecycle keeps them.
    objects
        .set_object_lock_configuration(
            "locked",
            keel_catalog::ObjectLock {
                default_retention: Some(keel_catalog::DefaultRetention {
                    mode: Compliance,
                    days: Some(1),
                    years: None,
                }),
            },
        )
        .unwrap();
    let old = put_locked(&objects, "d", b"old", Lock::default()).unwrap();
    put_locked(&objects, "d", b"new", Lock::default()).unwrap();
    let stored = objects
        .get_manifest("locked", "d", Some(VersionId::parse(&old).unwrap()))
        .unwrap();
    // A day from the write, on the layer's clock (which reads real time as it goes: the
    // manifest's time and the retention's start may be a few ms apart).
    let after_write = stored.lock.retention.unwrap().until_unix_ms - stored.modified_unix_ms;
    assert!(
        (86_400_000..86_400_000 + 1_000).contains(&after_write),
        "{after_write} ms"
    );
    objects
        .set_bucket_lifecycle(
            "locked",
            vec![keel_catalog::LifecycleRule {
                enabled: true,
                noncurrent_expiration_days: Some(1),
                ..Default::default()
            }],
        )
        .unwrap();
    let report = objects
        .apply_lifecycle(objects.wall_unix_ms() + 3 * 86_400_000)
        .unwrap();
    assert_eq!(report.versions_expired, 0);
    assert_eq!(read_version(&objects, "locked", "d", Some(&old)), b"old");
    // A day later on the layer's clock the default retention has ended: lifecycle expires it.
    clock.jump_wall(86_400_000);
    let report = objects
        .apply_lifecycle(objects.wall_unix_ms() + 3 * 86_400_000)
        .unwrap();
    assert_eq!(report.versions_expired, 1);

    // No lock on a bucket without object lock.
    assert!(matches!(
        objects.set_object_lock("bucket", "k", None, LockChange::LegalHold(true), false),
        Err(ObjectError::ObjectLockNotEnabled(_))
    ));
    let mut manifest = put(&objects, "bucket", "k", b"plain");
    manifest.lock = retention(&objects, Governance, 60_000);
    assert!(matches!(
        objects.put_object("bucket", "k", manifest, &PutCondition::default()),
        Err(ObjectError::ObjectLockNotEnabled(_))
    ));
}
