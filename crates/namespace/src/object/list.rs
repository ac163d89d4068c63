//! Listing a bucket: a range scan of its manifests with S3's prefix, delimiter, marker and
//! max-keys semantics.
//!
//! Keys sort by their UTF-8 bytes, which is S3's order. With a delimiter, every key whose rest
//! (after the prefix) contains the delimiter rolls up into one common prefix; once a common
//! prefix is emitted the scan jumps past every key that starts with it, so a listing costs
//! O(returned entries), not O(keys under the prefix).

use keel_store::Store;

use super::records::{self, Manifest};
use super::{store_error, ObjectError, Objects, SCAN_BATCH_RECORDS};

/// Most entries (keys plus common prefixes) one listing returns, as in S3.
pub const LIST_ENTRIES_MAX: usize = 1000;

/// Where a listing starts: after a key (exclusive), or after every key under a common prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListStart {
    AfterKey(String),
    AfterPrefix(String),
}

#[derive(Debug, Clone, Default)]
pub struct ListRequest {
    pub prefix: String,
    pub delimiter: Option<String>,
    pub start: Option<ListStart>,
    /// Clamped to [`LIST_ENTRIES_MAX`].
    pub max_entries: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListEntry {
    pub key: String,
    pub size_bytes: u64,
    pub etag: String,
    pub modified_unix_ms: i64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListResult {
    pub entries: Vec<ListEntry>,
    pub common_prefixes: Vec<String>,
    pub truncated: bool,
    /// Where the next page starts when `truncated`: after the last key or prefix returned.
    pub next: Option<ListStart>,
}

impl Objects {
    /// One page of the objects of `bucket`.
    pub fn list_objects(
        &self,
        bucket: &str,
        request: &ListRequest,
    ) -> Result<ListResult, ObjectError> {
        if self.bucket(bucket).is_none() {
            return Err(ObjectError::NoSuchBucket(bucket.to_string()));
        }
        list_records(
            self.store(),
            &records::objects_prefix(bucket),
            request,
            |value| {
                let manifest: Manifest = records::decode_manifest(value)?;
                Ok((
                    manifest.size_bytes,
                    manifest.etag,
                    manifest.modified_unix_ms,
                ))
            },
        )
    }
}

/// Lists records under `base` whose names (the key bytes after `base`) follow `request`.
/// `describe` turns a record value into (size, etag, mtime).
pub(crate) fn list_records(
    store: &Store,
    base: &[u8],
    request: &ListRequest,
    describe: impl Fn(&[u8]) -> Result<(u64, String, i64), ObjectError>,
) -> Result<ListResult, ObjectError> {
    let max_entries = request.max_entries.min(LIST_ENTRIES_MAX);
    let delimiter = request.delimiter.as_deref().filter(|d| !d.is_empty());
    let mut range_start = base.to_vec();
    range_start.extend_from_slice(request.prefix.as_bytes());
    let range_end = records::prefix_end(&range_start)
        .or_else(|| records::prefix_end(base))
        .unwrap_or_default();
    let mut cursor = range_start.clone();
    match &request.start {
        Some(ListStart::AfterKey(key)) => {
            let mut after = base.to_vec();
            after.extend_from_slice(key.as_bytes());
            cursor = cursor.max(records::successor(&after));
        }
        Some(ListStart::AfterPrefix(prefix)) => {
            let mut after = base.to_vec();
            after.extend_from_slice(prefix.as_bytes());
            match records::prefix_end(&after) {
                Some(end) => cursor = cursor.max(end),
                None => return Ok(ListResult::default()),
            }
        }
        None => {}
    }
    let mut result = ListResult::default();
    let mut count = 0usize;
    'scan: while cursor < range_end {
        let want = (max_entries - count + 1).min(SCAN_BATCH_RECORDS);
        let batch = store
            .scan(&cursor, &range_end, want)
            .map_err(|e| store_error("listing objects", e))?;
        if batch.is_empty() {
            break;
        }
        for (key, value) in &batch {
            let name_bytes = key.get(base.len()..).unwrap_or_default();
            let name = std::str::from_utf8(name_bytes).map_err(|_| ObjectError::CorruptRecord {
                what: "object key in the index".into(),
                reason: "not UTF-8".into(),
            })?;
            let rest = name.get(request.prefix.len()..).unwrap_or_default();
            if let Some(delimiter) = delimiter {
                if let Some(position) = rest.find(delimiter) {
                    let common = &name[..request.prefix.len() + position + delimiter.len()];
                    if count == max_entries {
                        result.truncated = true;
                        break 'scan;
                    }
                    result.common_prefixes.push(common.to_string());
                    result.next = Some(ListStart::AfterPrefix(common.to_string()));
                    count += 1;
                    let mut skip = base.to_vec();
                    skip.extend_from_slice(common.as_bytes());
                    match records::prefix_end(&skip) {
                        Some(next) => cursor = next,
                        None => break 'scan,
                    }
                    continue 'scan;
                }
            }
            if count == max_entries {
                result.truncated = true;
                break 'scan;
            }
            let (size_bytes, etag, modified_unix_ms) = describe(value)?;
            result.entries.push(ListEntry {
                key: name.to_string(),
                size_bytes,
                etag,
                modified_unix_ms,
            });
            result.next = Some(ListStart::AfterKey(name.to_string()));
            count += 1;
            cursor = records::successor(key);
        }
    }
    if !result.truncated {
        result.next = None;
    }
    Ok(result)
}
