//! Bucket policies: the common subset of AWS's JSON policy language, parsed when a policy is
//! put (so a stored policy always parses) and evaluated for every request to its bucket.
//!
//! Supported: `Version`, `Statement` (one or a list) with `Sid`, `Effect` (`Allow` / `Deny`),
//! `Principal` (`"*"`, `{"AWS": "*"}`, `{"AWS": [...]}` naming access key ids or IAM user ARNs
//! ending `:user/<access key id>`), `Action` (`s3:*`, `s3:Get*`, exact names, case-insensitive),
//! `Resource` (`arn:aws:s3:::bucket`, `arn:aws:s3:::bucket/prefix*`, with `*` and `?`), and
//! `Condition` with `StringEquals` / `StringNotEquals` / `StringLike` / `StringNotLike` on
//! `s3:prefix` and `Bool` on `aws:SecureTransport`. Anything else (`NotPrincipal`, `NotAction`,
//! `NotResource`, other condition operators or keys) is refused at put time, never ignored:
//! a statement Keel cannot evaluate must not silently allow or fail to deny.
//!
//! Evaluation follows AWS: an explicit `Deny` that matches wins; otherwise a matching `Allow`
//! allows; otherwise the policy has no opinion and Keel's own rules (owner, grants, canned
//! ACL) decide.

use serde_json::Value;

/// Largest policy accepted, in bytes (AWS's limit).
pub const POLICY_SIZE_MAX_BYTES: usize = 20 * 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    statements: Vec<Statement>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Statement {
    allow: bool,
    /// `None`: any principal, anonymous callers included.
    principals: Option<Vec<String>>,
    actions: Vec<String>,
    resources: Vec<String>,
    conditions: Vec<Condition>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Condition {
    Prefix {
        operator: StringOperator,
        values: Vec<String>,
    },
    SecureTransport(bool),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StringOperator {
    Equals,
    NotEquals,
    Like,
    NotLike,
}

/// What a policy says about a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Allow,
    Deny,
    /// No statement matches: Keel's own rules decide.
    Silent,
}

/// One request as a policy sees it.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    /// The signing access key; `None` for an anonymous request.
    pub principal: Option<&'a str>,
    /// `s3:GetObject`, `s3:ListBucket`, ...
    pub action: &'a str,
    /// `arn:aws:s3:::bucket` or `arn:aws:s3:::bucket/key`.
    pub resource: &'a str,
    /// The `prefix` of a listing, if any (`s3:prefix`).
    pub prefix: Option<&'a str>,
    /// Whether the request came over TLS (`aws:SecureTransport`).
    pub secure_transport: bool,
}

/// Parses and checks a policy document; the error says what is wrong or unsupported.
pub fn parse(bucket: &str, text: &str) -> Result<Policy, String> {
    if text.len() > POLICY_SIZE_MAX_BYTES {
        return Err(format!(
            "policies are at most {POLICY_SIZE_MAX_BYTES} bytes ({} given)",
            text.len()
        ));
    }
    let document: Value =
        serde_json::from_str(text).map_err(|error| format!("not valid JSON: {error}"))?;
    let object = document.as_object().ok_or("a policy is a JSON object")?;
    for key in object.keys() {
        if !matches!(key.as_str(), "Version" | "Id" | "Statement") {
            return Err(format!("unknown policy element {key:?}"));
        }
    }
    if let Some(version) = object.get("Version") {
        if !matches!(version.as_str(), Some("2012-10-17" | "2008-10-17")) {
            return Err("Version must be \"2012-10-17\" or \"2008-10-17\"".into());
        }
    }
    let statements = match object.get("Statement") {
        Some(Value::Array(list)) => list.iter().collect::<Vec<_>>(),
        Some(single @ Value::Object(_)) => vec![single],
        _ => return Err("a policy needs a Statement (an object or a list)".into()),
    };
    if statements.is_empty() {
        return Err("a policy needs at least one statement".into());
    }
    let statements = statements
        .into_iter()
        .map(|statement| parse_statement(bucket, statement))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Policy { statements })
}

fn strings(value: &Value, what: &str) -> Result<Vec<String>, String> {
    match value {
        Value::String(one) => Ok(vec![one.clone()]),
        Value::Array(list) if !list.is_empty() => list
            .iter()
            .map(|item| {
                item.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| format!("{what} lists only strings"))
            })
            .collect(),
        _ => Err(format!("{what} is a string or a non-empty list of strings")),
    }
}

fn parse_statement(bucket: &str, value: &Value) -> Result<Statement, String> {
    let object = value.as_object().ok_or("a statement is a JSON object")?;
    for key in object.keys() {
        match key.as_str() {
            "Sid" | "Effect" | "Principal" | "Action" | "Resource" | "Condition" => {}
            "NotPrincipal" | "NotAction" | "NotResource" => {
                return Err(format!(
                    "{key} is not supported: name what the statement covers"
                ))
            }
            other => return Err(format!("unknown statement element {other:?}")),
        }
    }
    let allow = match object.get("Effect").and_then(Value::as_str) {
        Some("Allow") => true,
        Some("Deny") => false,
        _ => return Err("a statement's Effect is \"Allow\" or \"Deny\"".into()),
    };
    let principals = match object.get("Principal") {
        Some(Value::String(star)) if star == "*" => None,
        Some(Value::Object(map)) => {
            if map.keys().any(|key| key != "AWS") {
                return Err("only AWS principals (access keys) are supported".into());
            }
            let listed = strings(map.get("AWS").unwrap_or(&Value::Null), "Principal.AWS")?;
            if listed.iter().any(|p| p == "*") {
                None
            } else {
                Some(listed)
            }
        }
        _ => return Err("a statement needs a Principal: \"*\" or {\"AWS\": ...}".into()),
    };
    let actions = strings(object.get("Action").unwrap_or(&Value::Null), "Action")?;
    for action in &actions {
        if !(action == "*" || action.to_ascii_lowercase().starts_with("s3:")) {
            return Err(format!("action {action:?} is not an S3 action (s3:...)"));
        }
    }
    let resources = strings(object.get("Resource").unwrap_or(&Value::Null), "Resource")?;
    let own = format!("arn:aws:s3:::{bucket}");
    for resource in &resources {
        // A resource must lie in this bucket: the bucket itself or its objects.
        if !(resource == &own || resource.starts_with(&format!("{own}/"))) {
            return Err(format!(
                "resource {resource:?} is outside the bucket ({own} or {own}/...)"
            ));
        }
    }
    let conditions = match object.get("Condition") {
        None => Vec::new(),
        Some(Value::Object(operators)) => parse_conditions(operators)?,
        Some(_) => return Err("a Condition is a JSON object".into()),
    };
    Ok(Statement {
        allow,
        principals,
        actions,
        resources,
        conditions,
    })
}

fn parse_conditions(operators: &serde_json::Map<String, Value>) -> Result<Vec<Condition>, String> {
    let mut conditions = Vec::new();
    for (operator, keys) in operators {
        let keys = keys
            .as_object()
            .ok_or_else(|| format!("condition {operator} maps keys to values"))?;
        for (key, values) in keys {
            let values = match values {
                Value::Bool(flag) => vec![flag.to_string()],
                other => strings(other, &format!("condition {operator} {key}"))?,
            };
            let condition = match (operator.as_str(), key.to_ascii_lowercase().as_str()) {
                ("Bool", "aws:securetransport") => {
                    let [value] = values.as_slice() else {
                        return Err("aws:SecureTransport takes one value".into());
                    };
                    Condition::SecureTransport(match value.as_str() {
                        "true" => true,
                        "false" => false,
                        _ => return Err("aws:SecureTransport is \"true\" or \"false\"".into()),
                    })
                }
                (operator, "s3:prefix") => Condition::Prefix {
                    operator: match operator {
                        "StringEquals" => StringOperator::Equals,
                        "StringNotEquals" => StringOperator::NotEquals,
                        "StringLike" => StringOperator::Like,
                        "StringNotLike" => StringOperator::NotLike,
                        other => {
                            return Err(format!("condition operator {other} on s3:prefix is not supported"))
                        }
                    },
                    values,
                },
                (operator, key) => {
                    return Err(format!(
                        "condition {operator} on {key} is not supported (s3:prefix, aws:SecureTransport)"
                    ))
                }
            };
            conditions.push(condition);
        }
    }
    Ok(conditions)
}

/// Matches `text` against a pattern with `*` (any run) and `?` (any one character).
fn glob(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((star_p, star_t)) = star {
            pi = star_p + 1;
            ti = star_t + 1;
            star = Some((star_p, star_t + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

impl Statement {
    fn matches(&self, request: &Request<'_>) -> bool {
        let principal = match (&self.principals, request.principal) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(listed), Some(key)) => listed.iter().any(|p| {
                p == key
                    || p.strip_suffix(key)
                        .is_some_and(|arn| arn.ends_with(":user/"))
            }),
        };
        let action = self.actions.iter().any(|pattern| {
            glob(
                &pattern.to_ascii_lowercase(),
                &request.action.to_ascii_lowercase(),
            )
        });
        let resource = self
            .resources
            .iter()
            .any(|pattern| glob(pattern, request.resource));
        principal && action && resource && self.conditions.iter().all(|c| c.holds(request))
    }
}

impl Condition {
    fn holds(&self, request: &Request<'_>) -> bool {
        match self {
            Condition::SecureTransport(wanted) => request.secure_transport == *wanted,
            Condition::Prefix { operator, values } => {
                // A request without a prefix has an empty one.
                let prefix = request.prefix.unwrap_or("");
                let any = |like: bool| {
                    values
                        .iter()
                        .any(|v| if like { glob(v, prefix) } else { v == prefix })
                };
                match operator {
                    StringOperator::Equals => any(false),
                    StringOperator::NotEquals => !any(false),
                    StringOperator::Like => any(true),
                    StringOperator::NotLike => !any(true),
                }
            }
        }
    }
}

impl Policy {
    /// Whether the policy allows anyone (any principal, anonymous callers included) to do
    /// something (GetBucketPolicyStatus's `IsPublic`).
    pub fn is_public(&self) -> bool {
        self.statements
            .iter()
            .any(|statement| statement.allow && statement.principals.is_none())
    }

    pub fn decide(&self, request: &Request<'_>) -> Decision {
        let matching = || self.statements.iter().filter(|s| s.matches(request));
        if matching().any(|s| !s.allow) {
            Decision::Deny
        } else if matching().any(|s| s.allow) {
            Decision::Allow
        } else {
            Decision::Silent
        }
    }
}

/// The IAM action an S3 operation needs (`s3:` and the operation's name, except where AWS
/// names it otherwise).
pub fn action_of(operation: &str) -> String {
    let name = match operation {
        "HeadObject" => "GetObject",
        "CopyObject"
        | "PostObject"
        | "CreateMultipartUpload"
        | "UploadPart"
        | "UploadPartCopy"
        | "CompleteMultipartUpload" => "PutObject",
        "DeleteObjects" => "DeleteObject",
        "ListObjects" | "ListObjectsV2" | "HeadBucket" => "ListBucket",
        "ListObjectVersions" => "ListBucketVersions",
        "ListParts" => "ListMultipartUploadParts",
        "ListMultipartUploads" => "ListBucketMultipartUploads",
        "GetBucketCors" => "GetBucketCORS",
        "PutBucketCors" | "DeleteBucketCors" => "PutBucketCORS",
        "GetBucketLifecycleConfiguration" => "GetLifecycleConfiguration",
        "PutBucketLifecycleConfiguration" | "DeleteBucketLifecycle" => "PutLifecycleConfiguration",
        "DeleteBucketTagging" => "PutBucketTagging",
        "GetObjectLockConfiguration" => "GetBucketObjectLockConfiguration",
        "PutObjectLockConfiguration" => "PutBucketObjectLockConfiguration",
        other => other,
    };
    format!("s3:{name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request<'a>(principal: Option<&'a str>, action: &'a str, resource: &'a str) -> Request<'a> {
        Request {
            principal,
            action,
            resource,
            prefix: None,
            secure_transport: false,
        }
    }

    // Proves wildcards: `*` spans any run (empty included), `?` one character.
    #[test]
    fn globs_match_like_aws() {
        assert!(glob("arn:aws:s3:::b/*", "arn:aws:s3:::b/x/y"));
        assert!(glob("arn:aws:s3:::b/*", "arn:aws:s3:::b/"));
        assert!(!glob("arn:aws:s3:::b/*", "arn:aws:s3:::bb/x"));
        assert!(glob("s3:get*", "s3:getobject"));
        assert!(glob("a?c", "abc") && !glob("a?c", "ac"));
        assert!(glob("*a*b", "xxaxxb") && !glob("*a*b", "xxbxxa"));
    }

    // Proves a public-read policy allows anonymous reads of objects and nothing else, an
    // explicit Deny beats an Allow, principals match by key id or user ARN, and conditions on
    // s3:prefix and aws:SecureTransport are applied.
    #[test]
    fn statements_allow_deny_and_stay_silent() {
        let policy = parse(
            "b",
            r#"{"Version": "2012-10-17", "Statement": [
                {"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject",
                 "Resource": "arn:aws:s3:::b/public/*"},
                {"Effect": "Deny", "Principal": "*", "Action": "s3:GetObject",
                 "Resource": "arn:aws:s3:::b/public/secret*"},
                {"Effect": "Allow", "Principal": {"AWS": ["arn:aws:iam::1:user/READER", "LISTER"]},
                 "Action": ["s3:ListBucket"], "Resource": "arn:aws:s3:::b",
                 "Condition": {"StringLike": {"s3:prefix": ["logs/*"]}}},
                {"Effect": "Deny", "Principal": {"AWS": "*"}, "Action": "s3:*",
                 "Resource": ["arn:aws:s3:::b", "arn:aws:s3:::b/*"],
                 "Condition": {"Bool": {"aws:SecureTransport": "false"},
                               "StringEquals": {"s3:prefix": "forbidden/"}}}
            ]}"#,
        )
        .expect("the policy parses");
        let get = |principal, key: &str| {
            let resource = format!("arn:aws:s3:::b/{key}");
            policy.decide(&request(principal, "s3:GetObject", &resource))
        };
        assert!(policy.is_public());
        assert_eq!(get(None, "public/a.txt"), Decision::Allow);
        assert_eq!(get(None, "public/secret.txt"), Decision::Deny);
        assert_eq!(get(None, "private/a.txt"), Decision::Silent);
        assert_eq!(
            policy.decide(&request(None, "s3:PutObject", "arn:aws:s3:::b/public/a")),
            Decision::Silent
        );
        let list = |principal, prefix| {
            policy.decide(&Request {
                prefix,
                ..request(principal, "s3:ListBucket", "arn:aws:s3:::b")
            })
        };
        assert_eq!(list(Some("READER"), Some("logs/2026")), Decision::Allow);
        assert_eq!(list(Some("LISTER"), Some("logs/")), Decision::Allow);
        assert_eq!(list(Some("READER"), Some("other/")), Decision::Silent);
        assert_eq!(list(Some("STRANGER"), Some("logs/")), Decision::Silent);
        assert_eq!(list(None, Some("logs/")), Decision::Silent);
        assert_eq!(list(Some("READER"), Some("forbidden/")), Decision::Deny);
        let tls = Request {
            prefix: Some("forbidden/"),
            secure_transport: true,
            ..request(Some("READER"), "s3:ListBucket", "arn:aws:s3:::b")
        };
        assert_eq!(policy.decide(&tls), Decision::Silent);
        let keyed = parse(
            "b",
            r#"{"Statement": [{"Effect": "Allow", "Principal": {"AWS": "READER"},
                "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/*"},
               {"Effect": "Deny", "Principal": "*", "Action": "s3:*", "Resource": "arn:aws:s3:::b"}]}"#,
        )
        .expect("the policy parses");
        assert!(
            !keyed.is_public(),
            "a Deny for everyone makes nothing public"
        );
    }

    // Proves what cannot be evaluated is refused rather than ignored.
    #[test]
    fn unsupported_or_malformed_policies_are_refused() {
        for bad in [
            "not json",
            "[]",
            r#"{"Statement": []}"#,
            r#"{"Version": "2099-01-01", "Statement": {"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/*"}}"#,
            r#"{"Statement": {"Effect": "Maybe", "Principal": "*", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/*"}}"#,
            r#"{"Statement": {"Effect": "Allow", "NotPrincipal": "*", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/*"}}"#,
            r#"{"Statement": {"Effect": "Allow", "Principal": "*", "Action": "iam:PassRole", "Resource": "arn:aws:s3:::b/*"}}"#,
            r#"{"Statement": {"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::other/*"}}"#,
            r#"{"Statement": {"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/*", "Condition": {"IpAddress": {"aws:SourceIp": "10.0.0.0/8"}}}}"#,
            r#"{"Statement": {"Effect": "Allow", "Principal": {"Service": "x"}, "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/*"}}"#,
        ] {
            assert!(parse("b", bad).is_err(), "accepted: {bad}");
        }
        let huge = format!(
            "{{\"Statement\": \"{}\"}}",
            "x".repeat(POLICY_SIZE_MAX_BYTES)
        );
        assert!(parse("b", &huge)
            .expect_err("too large")
            .contains("at most"));
    }
}
