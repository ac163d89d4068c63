//! A bucket's CORS rules (S3's `CORSConfiguration`): what a configuration may hold, and which
//! rule, if any, lets a browser page from another origin make a request.

use keel_catalog::CorsRule;

use super::ObjectError;

/// Most rules a bucket holds (S3's limit).
pub const CORS_RULES_MAX: usize = 100;

/// The methods a rule may allow.
pub const CORS_METHODS: [&str; 5] = ["GET", "PUT", "POST", "DELETE", "HEAD"];

/// S3's rules for a configuration: at most [`CORS_RULES_MAX`] rules (none: no CORS), each with
/// an origin and a method at least, methods among [`CORS_METHODS`], at most one `*` per origin and allowed
/// header, no negative max age.
pub fn validate_cors(rules: &[CorsRule]) -> Result<(), ObjectError> {
    let invalid = |detail: String| Err(ObjectError::InvalidArgument(detail));
    if rules.len() > CORS_RULES_MAX {
        return invalid(format!(
            "a bucket holds at most {CORS_RULES_MAX} CORS rules ({} given)",
            rules.len()
        ));
    }
    for rule in rules {
        if rule.allowed_origins.is_empty() || rule.allowed_methods.is_empty() {
            return invalid("every CORS rule needs an AllowedOrigin and an AllowedMethod".into());
        }
        if let Some(method) = rule
            .allowed_methods
            .iter()
            .find(|method| !CORS_METHODS.contains(&method.as_str()))
        {
            return invalid(format!(
                "unsupported CORS method {method:?}: use {}",
                CORS_METHODS.join(", ")
            ));
        }
        if let Some(pattern) = rule
            .allowed_origins
            .iter()
            .chain(&rule.allowed_headers)
            .find(|pattern| pattern.matches('*').count() > 1)
        {
            return invalid(format!("{pattern:?} holds more than one wildcard (*)"));
        }
        if rule.max_age_seconds.is_some_and(|age| age < 0) {
            return invalid("MaxAgeSeconds must not be negative".into());
        }
    }
    Ok(())
}

/// Whether `pattern` matches `value`: equal, or with its one `*` standing for any run of
/// characters.
fn wildcard_match(pattern: &str, value: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == value,
        Some((head, tail)) => {
            value.len() >= head.len() + tail.len()
                && value.starts_with(head)
                && value.ends_with(tail)
        }
    }
}

/// The first rule that lets `origin` make a `method` request sending `headers` (the headers a
/// preflight announces; none for the request itself). Origins and methods compare exactly,
/// header names without regard to case.
pub fn matching_rule<'a>(
    rules: &'a [CorsRule],
    origin: &str,
    method: &str,
    headers: &[String],
) -> Option<&'a CorsRule> {
    rules.iter().find(|rule| {
        rule.allowed_origins
            .iter()
            .any(|allowed| wildcard_match(allowed, origin))
            && rule.allowed_methods.iter().any(|allowed| allowed == method)
            && headers.iter().all(|header| {
                let header = header.to_ascii_lowercase();
                rule.allowed_headers
                    .iter()
                    .any(|allowed| wildcard_match(&allowed.to_ascii_lowercase(), &header))
            })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(origins: &[&str], methods: &[&str], headers: &[&str]) -> CorsRule {
        CorsRule {
            allowed_origins: origins.iter().map(|s| s.to_string()).collect(),
            allowed_methods: methods.iter().map(|s| s.to_string()).collect(),
            allowed_headers: headers.iter().map(|s| s.to_string()).collect(),
            ..CorsRule::default()
        }
    }

    // Proves origins match exactly or through their one wildcard, methods exactly, and
    // announced headers case-insensitively against the allowed ones; the first match wins.
    #[test]
    fn rules_match_origin_method_and_headers() {
        let rules = vec![
            rule(&["https://*.example.com"], &["GET"], &[]),
            rule(
                &["https://app.test"],
                &["PUT", "GET"],
                &["Content-*", "x-amz-date"],
            ),
        ];
        assert!(matching_rule(&rules, "https://www.example.com", "GET", &[]).is_some());
        assert!(matching_rule(&rules, "https://example.com", "GET", &[]).is_none());
        assert!(matching_rule(&rules, "https://www.example.com", "PUT", &[]).is_none());
        let headers = vec!["content-type".to_string(), "X-Amz-Date".to_string()];
        let matched = matching_rule(&rules, "https://app.test", "PUT", &headers);
        assert_eq!(matched, Some(&rules[1]));
        let unknown = vec!["authorization".to_string()];
        assert!(matching_rule(&rules, "https://app.test", "PUT", &unknown).is_none());
        assert!(matching_rule(&rules, "http://app.test", "PUT", &[]).is_none());
        assert!(wildcard_match("*", "anything"));
        assert!(!wildcard_match("ab*ba", "aba"));
    }

    // Proves a configuration without origins or methods, with an unknown method, two wildcards
    // in one origin, a negative max age or too many rules is refused.
    #[test]
    fn invalid_configurations_are_refused() {
        assert!(validate_cors(&[rule(&["*"], &["GET"], &["*"])]).is_ok());
        assert!(validate_cors(&[rule(&[], &["GET"], &[])]).is_err());
        assert!(validate_cors(&[rule(&["*"], &[], &[])]).is_err());
        assert!(validate_cors(&[rule(&["*"], &["PATCH"], &[])]).is_err());
        assert!(validate_cors(&[rule(&["https://*.*.com"], &["GET"], &[])]).is_err());
        let mut negative = rule(&["*"], &["GET"], &[]);
        negative.max_age_seconds = Some(-1);
        assert!(validate_cors(&[negative]).is_err());
        let many = vec![rule(&["*"], &["GET"], &[]); CORS_RULES_MAX + 1];
        assert!(validate_cors(&many).is_err());
    }
}
