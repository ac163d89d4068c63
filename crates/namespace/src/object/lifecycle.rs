//! Lifecycle rules (S3's `LifecycleConfiguration`): objects expire a number of days after they
//! were last written, or at a date (in a versioned bucket expiring adds a delete marker, as a
//! DELETE does); noncurrent versions are deleted a number of days after a newer version
//! replaced them; delete markers left with no version behind them are removed; multipart
//! uploads are aborted a number of days after they began. The rules live with the bucket's
//! other settings (Raft metadata); [`Objects::apply_lifecycle`] applies them as of a moment the
//! caller gives (the server's clock in its worker; a test's own).

use keel_catalog::LifecycleRule;

use super::list::{ListRequest, ListStart, LIST_ENTRIES_MAX};
use super::records::VersionId;
use super::versions::VersionListRequest;
use super::{ObjectError, Objects};

/// Most rules a bucket holds (S3's limit).
pub const LIFECYCLE_RULES_MAX: usize = 1000;
const DAY_MS: i64 = 86_400_000;
/// Uploads looked at per page.
const UPLOADS_PAGE: usize = 1000;

/// S3's rules for a configuration: at most [`LIFECYCLE_RULES_MAX`] rules (none: no
/// lifecycle), ids unique and at most 255 characters, each rule with an action, days at
/// least 1.
pub fn validate_lifecycle(rules: &[LifecycleRule]) -> Result<(), ObjectError> {
    let invalid = |detail: String| Err(ObjectError::InvalidArgument(detail));
    if rules.len() > LIFECYCLE_RULES_MAX {
        return invalid(format!(
            "a bucket holds at most {LIFECYCLE_RULES_MAX} lifecycle rules ({} given)",
            rules.len()
        ));
    }
    let mut ids = std::collections::HashSet::new();
    for rule in rules {
        if let Some(id) = &rule.id {
            if id.chars().count() > 255 {
                return invalid(format!("lifecycle rule ID {id:?} is over 255 characters"));
            }
            if !ids.insert(id.as_str()) {
                return invalid(format!("lifecycle rule ID {id:?} is given more than once"));
            }
        }
        let expires = rule.expiration_days.is_some() || rule.expiration_date_unix_ms.is_some();
        if !expires
            && !rule.expired_object_delete_marker
            && rule.noncurrent_expiration_days.is_none()
            && rule.abort_incomplete_upload_days.is_none()
        {
            return invalid(
                "a lifecycle rule needs an Expiration, a NoncurrentVersionExpiration or an \
                 AbortIncompleteMultipartUpload"
                    .into(),
            );
        }
        if rule.expiration_days.is_some() && rule.expiration_date_unix_ms.is_some() {
            return invalid("an Expiration has Days or a Date, not both".into());
        }
        if expires && rule.expired_object_delete_marker {
            return invalid(
                "ExpiredObjectDeleteMarker cannot be given with Days or Date in an Expiration"
                    .into(),
            );
        }
        if [
            rule.expiration_days,
            rule.abort_incomplete_upload_days,
            rule.noncurrent_expiration_days,
        ]
        .contains(&Some(0))
        {
            return invalid("lifecycle days must be at least 1".into());
        }
    }
    Ok(())
}

/// Whether `rule` expires an object last written at `modified_unix_ms`, as of `now_unix_ms`.
fn object_expired(rule: &LifecycleRule, modified_unix_ms: i64, now_unix_ms: i64) -> bool {
    let by_age = rule.expiration_days.is_some_and(|days| {
        modified_unix_ms.saturating_add(i64::from(days) * DAY_MS) <= now_unix_ms
    });
    let by_date = rule
        .expiration_date_unix_ms
        .is_some_and(|date| date <= now_unix_ms);
    by_age || by_date
}

/// What one pass of the lifecycle rules did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LifecycleReport {
    pub objects_expired: u64,
    pub versions_expired: u64,
    pub delete_markers_removed: u64,
    pub uploads_aborted: u64,
}

impl Objects {
    /// Applies every bucket's enabled lifecycle rules as of `now_unix_ms`: deletes the objects
    /// they expire (each only if it was not written again since it was listed) and aborts the
    /// uploads they time out. Works through each rule's prefix a page at a time.
    pub fn apply_lifecycle(&self, now_unix_ms: i64) -> Result<LifecycleReport, ObjectError> {
        let mut report = LifecycleReport::default();
        let buckets: Vec<(String, Vec<LifecycleRule>)> = self
            .metadata()
            .catalog()
            .read()
            .bucket_settings
            .values()
            .filter(|settings| !settings.lifecycle.is_empty())
            .map(|settings| (settings.name.clone(), settings.lifecycle.clone()))
            .collect();
        for (bucket, rules) in buckets {
            for rule in rules.iter().filter(|rule| rule.enabled) {
                if rule.expiration_days.is_some() || rule.expiration_date_unix_ms.is_some() {
                    report.objects_expired += self.expire_objects(&bucket, rule, now_unix_ms)?;
                }
                if rule.noncurrent_expiration_days.is_some() || rule.expired_object_delete_marker {
                    self.expire_versions(&bucket, rule, now_unix_ms, &mut report)?;
                }
                if let Some(days) = rule.abort_incomplete_upload_days {
                    report.uploads_aborted +=
                        self.abort_old_uploads(&bucket, &rule.prefix, days, now_unix_ms)?;
                }
            }
        }
        Ok(report)
    }

    fn expire_objects(
        &self,
        bucket: &str,
        rule: &LifecycleRule,
        now_unix_ms: i64,
    ) -> Result<u64, ObjectError> {
        let mut expired = 0;
        let mut start = None;
        loop {
            let page = match self.list_objects(
                bucket,
                &ListRequest {
                    prefix: rule.prefix.clone(),
                    delimiter: None,
                    start: start.take(),
                    max_entries: LIST_ENTRIES_MAX,
                },
            ) {
                Err(ObjectError::NoSuchBucket(_)) => return Ok(expired),
                other => other?,
            };
            for entry in &page.entries {
                if object_expired(rule, entry.modified_unix_ms, now_unix_ms)
                    && self.delete_object_if(bucket, &entry.key, |manifest| {
                        manifest.modified_unix_ms == entry.modified_unix_ms
                    })?
                {
                    expired += 1;
                }
            }
            match (page.truncated, page.entries.last()) {
                (true, Some(last)) => start = Some(ListStart::AfterKey(last.key.clone())),
                _ => return Ok(expired),
            }
        }
    }

    /// Deletes the noncurrent versions `rule` expires and the delete markers it removes, a
    /// page of versions at a time. Each deletion is checked again under the key's lock: a
    /// version that became the newest meanwhile is not deleted as noncurrent, a marker that
    /// got versions behind it stays.
    fn expire_versions(
        &self,
        bucket: &str,
        rule: &LifecycleRule,
        now_unix_ms: i64,
        report: &mut LifecycleReport,
    ) -> Result<(), ObjectError> {
        let request = VersionListRequest {
            prefix: rule.prefix.clone(),
            max_entries: LIST_ENTRIES_MAX,
            ..VersionListRequest::default()
        };
        let mut after = Vec::new();
        // The key and write time of the version listed before (the next newer one).
        let mut newer: Option<(String, i64)> = None;
        loop {
            let page = match self.list_versions_after(bucket, &request, &after) {
                Err(ObjectError::NoSuchBucket(_)) => return Ok(()),
                other => other?,
            };
            for entry in &page.entries {
                let replaced_at = newer
                    .as_ref()
                    .filter(|(key, _)| *key == entry.key)
                    .map(|(_, at)| *at);
                newer = Some((entry.key.clone(), entry.modified_unix_ms));
                let id = VersionId::parse(&entry.version_id)?;
                let noncurrent_expired = match (rule.noncurrent_expiration_days, replaced_at) {
                    (Some(days), Some(replaced_at)) if !entry.is_latest => {
                        replaced_at.saturating_add(i64::from(days) * DAY_MS) <= now_unix_ms
                    }
                    _ => false,
                };
                // A version object lock protects stays (until a later pass finds it free).
                let unlocked = |outcome: Result<Option<_>, ObjectError>| match outcome {
                    Err(ObjectError::ObjectLocked { .. }) => Ok(false),
                    other => other.map(|deleted| deleted.is_some()),
                };
                if noncurrent_expired
                    && unlocked(
                        self.delete_version_if(bucket, &entry.key, id, false, |place| {
                            !place.is_latest
                        }),
                    )?
                {
                    report.versions_expired += 1;
                } else if rule.expired_object_delete_marker
                    && entry.delete_marker
                    && entry.is_latest
                    && unlocked(
                        self.delete_version_if(bucket, &entry.key, id, false, |place| place.only),
                    )?
                {
                    report.delete_markers_removed += 1;
                }
            }
            if !page.truncated {
                return Ok(());
            }
            after = page.next_after;
        }
    }

    fn abort_old_uploads(
        &self,
        bucket: &str,
        prefix: &str,
        days: u32,
        now_unix_ms: i64,
    ) -> Result<u64, ObjectError> {
        let mut aborted = 0;
        let mut after = None;
        loop {
            let (uploads, truncated) =
                match self.list_uploads_page(bucket, prefix, after.take(), UPLOADS_PAGE) {
                    Err(ObjectError::NoSuchBucket(_)) => return Ok(aborted),
                    other => other?,
                };
            for upload in &uploads {
                let due = upload
                    .initiated_unix_ms
                    .saturating_add(i64::from(days) * DAY_MS);
                if due <= now_unix_ms {
                    match self.abort_upload(bucket, &upload.key, &upload.upload_id) {
                        Ok(()) => aborted += 1,
                        // Completed or aborted meanwhile.
                        Err(ObjectError::NoSuchUpload(_)) => {}
                        Err(other) => return Err(other),
                    }
                }
            }
            match (truncated, uploads.last()) {
                (true, Some(last)) => after = Some((last.key.clone(), last.upload_id.clone())),
                _ => return Ok(aborted),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(days: Option<u32>, date: Option<i64>, abort: Option<u32>) -> LifecycleRule {
        LifecycleRule {
            enabled: true,
            expiration_days: days,
            expiration_date_unix_ms: date,
            abort_incomplete_upload_days: abort,
            ..LifecycleRule::default()
        }
    }

    // Proves an object expires exactly `days` after its last write, or at the date.
    #[test]
    fn objects_expire_by_age_or_date() {
        let thirty = rule(Some(30), None, None);
        assert!(!object_expired(&thirty, 0, 30 * DAY_MS - 1));
        assert!(object_expired(&thirty, 0, 30 * DAY_MS));
        let dated = rule(None, Some(5_000), None);
        assert!(!object_expired(&dated, 0, 4_999));
        assert!(object_expired(&dated, 4_000, 5_000));
    }

    // Proves rules without an action, with days and a date, with 0 days, with a repeated ID or
    // too many rules are refused.
    #[test]
    fn invalid_rules_are_refused() {
        assert!(validate_lifecycle(&[rule(Some(1), None, Some(2))]).is_ok());
        assert!(validate_lifecycle(&[rule(None, None, None)]).is_err());
        assert!(validate_lifecycle(&[rule(Some(1), Some(5), None)]).is_err());
        assert!(validate_lifecycle(&[rule(Some(0), None, None)]).is_err());
        assert!(validate_lifecycle(&[rule(None, None, Some(0))]).is_err());
        let mut twice = vec![rule(Some(1), None, None), rule(Some(2), None, None)];
        for one in &mut twice {
            one.id = Some("same".into());
        }
        assert!(validate_lifecycle(&twice).is_err());
        let many = vec![rule(Some(1), None, None); LIFECYCLE_RULES_MAX + 1];
        assert!(validate_lifecycle(&many).is_err());
    }
}
