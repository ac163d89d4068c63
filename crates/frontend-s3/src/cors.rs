//! CORS, from each bucket's rules (`PutBucketCors`): a browser's preflight (`OPTIONS`) is
//! answered here, before authentication (browsers send none with it), and the answer to a
//! request from an origin a rule allows gets the `Access-Control-*` headers. A request from an
//! origin no rule allows is served as it would be without CORS: the browser, not the server,
//! withholds the answer from the page.

use http::header::{
    HeaderName, HeaderValue, ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS,
    ACCESS_CONTROL_ALLOW_ORIGIN, ACCESS_CONTROL_EXPOSE_HEADERS, ACCESS_CONTROL_MAX_AGE,
    ACCESS_CONTROL_REQUEST_HEADERS, ACCESS_CONTROL_REQUEST_METHOD, CONTENT_TYPE, ORIGIN, VARY,
};
use http::{HeaderMap, Method, StatusCode};
use keel_catalog::CorsRule;
use keel_namespace::object::cors::matching_rule;
use keel_namespace::object::Objects;
use s3s::HttpResponse;

/// The bucket a path-style request names.
fn bucket_of(path: &str) -> Option<&str> {
    let bucket = path.trim_start_matches('/').split('/').next()?;
    (!bucket.is_empty()).then_some(bucket)
}

fn rules_of(objects: &Objects, path: &str) -> Vec<CorsRule> {
    bucket_of(path)
        .and_then(|bucket| objects.bucket_settings(bucket))
        .map(|settings| settings.cors)
        .unwrap_or_default()
}

fn header(value: &str) -> Option<HeaderValue> {
    HeaderValue::from_str(value).ok()
}

/// The headers that tell the browser what `rule` allows `origin`.
fn allow(headers: &mut HeaderMap, rule: &CorsRule, origin: &str) {
    let any_origin = rule.allowed_origins.iter().any(|allowed| allowed == "*");
    if let Some(value) = header(if any_origin { "*" } else { origin }) {
        headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, value);
    }
    if let Some(value) = header(&rule.allowed_methods.join(", ")) {
        headers.insert(ACCESS_CONTROL_ALLOW_METHODS, value);
    }
    if !rule.expose_headers.is_empty() {
        if let Some(value) = header(&rule.expose_headers.join(", ")) {
            headers.insert(ACCESS_CONTROL_EXPOSE_HEADERS, value);
        }
    }
    if let Some(age) = rule.max_age_seconds {
        headers.insert(ACCESS_CONTROL_MAX_AGE, HeaderValue::from(age));
    }
    headers.append(VARY, HeaderValue::from_static("Origin"));
}

/// An S3 error answer given before s3s sees the request: `status`, and an XML body with
/// `code` and `message`.
pub(crate) fn refusal(status: StatusCode, code: &str, message: &str) -> HttpResponse {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>{message}</Message></Error>"
    );
    let mut response = HttpResponse::new(s3s::Body::from(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/xml"));
    response
}

/// The answer to a preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`):
/// 200 with what the first matching rule allows, 403 when no rule allows the request (or the
/// bucket has none), 400 when the request is not a preflight. `None` for any other method.
pub(crate) fn preflight(
    objects: &Objects,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
) -> Option<HttpResponse> {
    if method != Method::OPTIONS {
        return None;
    }
    let text = |name: HeaderName| headers.get(name).and_then(|value| value.to_str().ok());
    let (Some(origin), Some(requested)) = (text(ORIGIN), text(ACCESS_CONTROL_REQUEST_METHOD))
    else {
        return Some(refusal(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "Insufficient information. Origin request header needed.",
        ));
    };
    let rules = rules_of(objects, path);
    if rules.is_empty() {
        return Some(refusal(
            StatusCode::FORBIDDEN,
            "AccessForbidden",
            "CORSResponse: CORS is not enabled for this bucket.",
        ));
    }
    let asked: Vec<String> = text(ACCESS_CONTROL_REQUEST_HEADERS)
        .map(|list| {
            list.split(',')
                .map(|name| name.trim().to_string())
                .filter(|name| !name.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let Some(rule) = matching_rule(&rules, origin, requested, &asked) else {
        return Some(refusal(
            StatusCode::FORBIDDEN,
            "AccessForbidden",
            "CORSResponse: This CORS request is not allowed. This is usually because the \
             evaluation of Origin, request method / Access-Control-Request-Method or \
             Access-Control-Request-Headers are not whitelisted by the resource's CORS spec.",
        ));
    };
    let mut response = HttpResponse::new(s3s::Body::empty());
    allow(response.headers_mut(), rule, origin);
    if !asked.is_empty() {
        if let Some(value) = header(&asked.join(", ")) {
            response
                .headers_mut()
                .insert(ACCESS_CONTROL_ALLOW_HEADERS, value);
        }
    }
    for varies in [
        "Access-Control-Request-Headers",
        "Access-Control-Request-Method",
    ] {
        response
            .headers_mut()
            .append(VARY, HeaderValue::from_static(varies));
    }
    Some(response)
}

/// Adds the `Access-Control-*` headers to the answer of a `method` request with `origin` when
/// a rule of its bucket allows it.
pub(crate) fn decorate(
    objects: &Objects,
    method: &Method,
    path: &str,
    origin: &str,
    response: &mut HttpResponse,
) {
    let rules = rules_of(objects, path);
    if let Some(rule) = matching_rule(&rules, origin, method.as_str(), &[]) {
        allow(response.headers_mut(), rule, origin);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves the bucket is the path's first segment, and a path without one names none.
    #[test]
    fn the_bucket_is_the_first_path_segment() {
        assert_eq!(bucket_of("/photos/a/b.jpg"), Some("photos"));
        assert_eq!(bucket_of("/photos"), Some("photos"));
        assert_eq!(bucket_of("/"), None);
    }
}
