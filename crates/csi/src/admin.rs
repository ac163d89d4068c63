//! The Keel admin API as the driver uses it: JSON over HTTP with the admin token, blocking
//! calls (ureq) moved off the async runtime, HTTP failures mapped to gRPC status codes.

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use tonic::Status;

/// How often a deletion job is polled until it ends.
const JOB_POLL_INTERVAL: Duration = Duration::from_millis(100);
/// A call to the admin API that takes longer than this fails (the CO retries).
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

#[derive(Clone)]
pub struct Admin {
    base: String,
    token: String,
    agent: ureq::Agent,
}

/// A volume as `GET /api/v1/volumes` lists it.
#[derive(Deserialize, Debug, Clone)]
pub struct VolumeJson {
    pub name: String,
    pub size_bytes: u64,
    /// `volume@snapshot` for a clone.
    pub origin: Option<String>,
    /// The node serving it and the nodes holding its replicas (ids).
    #[serde(default)]
    pub primary: Option<u64>,
    #[serde(default)]
    pub replicas: Vec<u64>,
}

/// A snapshot as `GET /api/v1/volumes/NAME/snapshots` lists it.
#[derive(Deserialize, Debug, Clone)]
pub struct SnapshotJson {
    pub name: String,
    pub guid: String,
    pub size_bytes: u64,
    pub created_unix_seconds: u64,
}

/// The NBD attaches a node refused lately (`GET /api/v1/nbd/refusals`): those asked for, and
/// the id of the last it recorded.
#[derive(Deserialize, Debug, Clone)]
pub struct RefusalsJson {
    pub last: u64,
    pub refusals: Vec<RefusalJson>,
}

#[derive(Deserialize, Debug, Clone)]
pub struct RefusalJson {
    pub reason: String,
}

/// A node as `GET /api/v1/nodes` lists it.
#[derive(Debug, Clone)]
pub struct NodeJson {
    pub id: u64,
    pub name: String,
    pub admin: Option<String>,
}

/// A failed call: the HTTP status (0 when the server could not be reached) and its message.
#[derive(Debug)]
pub struct Failure {
    pub http: u16,
    pub message: String,
}

impl Failure {
    pub fn not_found(&self) -> bool {
        self.http == 404
    }
}

impl From<Failure> for Status {
    fn from(failure: Failure) -> Status {
        let message = format!("keel: {}", failure.message);
        match failure.http {
            0 | 421 | 503 | 504 => Status::unavailable(message),
            400 => Status::invalid_argument(message),
            401 | 403 => Status::permission_denied(message),
            404 => Status::not_found(message),
            409 => Status::failed_precondition(message),
            507 => Status::resource_exhausted(message),
            _ => Status::internal(message),
        }
    }
}

#[derive(Clone, Copy)]
enum Method {
    Get,
    Post,
    Delete,
}

/// Characters a path segment keeps as they are (RFC 3986's unreserved set).
const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// Percent-encodes one path segment.
pub fn encode(segment: &str) -> String {
    percent_encoding::utf8_percent_encode(segment, SEGMENT).to_string()
}

impl Admin {
    pub fn new(address: &str, token: String) -> Admin {
        let base = if address.starts_with("http") {
            address.trim_end_matches('/').to_string()
        } else {
            format!("http://{address}")
        };
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(CALL_TIMEOUT))
            .build()
            .new_agent();
        Admin { base, token, agent }
    }

    async fn call<T: DeserializeOwned + Send + 'static>(
        &self,
        method: Method,
        path: String,
        body: Option<Value>,
    ) -> Result<T, Failure> {
        let admin = self.clone();
        tokio::task::spawn_blocking(move || admin.call_blocking(method, &path, body))
            .await
            .map_err(|error| Failure {
                http: 500,
                message: format!("admin call task failed: {error}"),
            })?
    }

    fn call_blocking<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<T, Failure> {
        let url = format!("{}{path}", self.base);
        let bearer = format!("Bearer {}", self.token);
        let response = match method {
            Method::Get => self.agent.get(&url).header("Authorization", &bearer).call(),
            Method::Delete => self
                .agent
                .delete(&url)
                .header("Authorization", &bearer)
                .call(),
            Method::Post => self
                .agent
                .post(&url)
                .header("Authorization", &bearer)
                .send_json(body.unwrap_or(Value::Null)),
        };
        let mut response = response.map_err(|error| Failure {
            http: 0,
            message: format!("cannot reach the admin API at {}: {error}", self.base),
        })?;
        let status = response.status().as_u16();
        let body: Value = response.body_mut().read_json().unwrap_or(Value::Null);
        if !(200..300).contains(&status) {
            let message = body
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("no detail")
                .to_string();
            return Err(Failure {
                http: status,
                message,
            });
        }
        serde_json::from_value(body).map_err(|error| Failure {
            http: 500,
            message: format!("unexpected answer from {path}: {error}"),
        })
    }

    /// The same server API at another node's admin address (same token: the cluster's nodes
    /// share it, see `keel server --admin-token-file`).
    pub fn at(&self, address: &str) -> Admin {
        Admin::new(address, self.token.clone())
    }

    /// The cluster's storage nodes (not witnesses, not removed): id, name and admin address.
    pub async fn nodes(&self) -> Result<Vec<NodeJson>, Failure> {
        let nodes: Vec<Value> = self.call(Method::Get, "/api/v1/nodes".into(), None).await?;
        Ok(nodes
            .iter()
            .filter_map(|node| {
                let record = &node["record"];
                if record["role"] != "Storage" || record["removed"] == true {
                    return None;
                }
                Some(NodeJson {
                    id: record["id"].as_u64()?,
                    name: record["name"].as_str()?.to_string(),
                    admin: record["addresses"]["admin"].as_str().map(str::to_string),
                })
            })
            .collect())
    }

    /// The attaches of `export` this node refused after refusal `after` (all it keeps without).
    /// Blocking: for node work, which runs on its own thread.
    pub fn refusals_blocking(
        &self,
        export: &str,
        after: Option<u64>,
    ) -> Result<RefusalsJson, Failure> {
        let mut path = format!("/api/v1/nbd/refusals?export={}", encode(export));
        if let Some(after) = after {
            path.push_str(&format!("&after={after}"));
        }
        self.call_blocking(Method::Get, &path, None)
    }

    pub async fn status(&self) -> Result<Value, Failure> {
        self.call(Method::Get, "/api/v1/status".into(), None).await
    }

    pub async fn volumes(&self) -> Result<Vec<VolumeJson>, Failure> {
        self.call(Method::Get, "/api/v1/volumes".into(), None).await
    }

    /// The volume, or None when it does not exist. From the list, which any node answers
    /// (a volume's own page only its primary does).
    pub async fn volume(&self, name: &str) -> Result<Option<VolumeJson>, Failure> {
        Ok(self.volumes().await?.into_iter().find(|v| v.name == name))
    }

    pub async fn create_volume(&self, request: Value) -> Result<VolumeJson, Failure> {
        self.call(Method::Post, "/api/v1/volumes".into(), Some(request))
            .await
    }

    pub async fn resize_volume(&self, name: &str, size_bytes: u64) -> Result<Value, Failure> {
        let path = format!("/api/v1/volumes/{}/resize", encode(name));
        let body = serde_json::json!({ "size_bytes": size_bytes });
        self.call(Method::Post, path, Some(body)).await
    }

    /// Deletes a volume and waits for the deletion job to end.
    pub async fn delete_volume(&self, name: &str) -> Result<(), Failure> {
        let path = format!("/api/v1/volumes/{}", encode(name));
        let started: Value = self.call(Method::Delete, path, None).await?;
        let Some(job) = started["job"].as_u64() else {
            return Ok(());
        };
        loop {
            let status: Value = self
                .call(Method::Get, format!("/api/v1/jobs/{job}"), None)
                .await?;
            match status["state"].as_str() {
                Some("done") => return Ok(()),
                Some("failed") => {
                    let message = status["error"].as_str().unwrap_or("no detail").to_string();
                    // The job reports the volume error's text; clones still depending on it
                    // is the one refusal the CO must see as a precondition.
                    let http = if message.contains("in use") || message.contains("clone") {
                        409
                    } else {
                        500
                    };
                    return Err(Failure { http, message });
                }
                _ => tokio::time::sleep(JOB_POLL_INTERVAL).await,
            }
        }
    }

    /// The volume's snapshots, without their space use (which would cost a scan of the
    /// volume's blocks on every call).
    pub async fn snapshots(&self, volume: &str) -> Result<Vec<SnapshotJson>, Failure> {
        let path = format!("/api/v1/volumes/{}/snapshots?usage=false", encode(volume));
        self.call(Method::Get, path, None).await
    }

    pub async fn create_snapshot(&self, volume: &str, name: &str) -> Result<SnapshotJson, Failure> {
        let path = format!("/api/v1/volumes/{}/snapshots", encode(volume));
        let body = serde_json::json!({ "name": name });
        self.call(Method::Post, path, Some(body)).await
    }

    pub async fn delete_snapshot(&self, volume: &str, name: &str) -> Result<(), Failure> {
        let path = format!(
            "/api/v1/volumes/{}/snapshots/{}",
            encode(volume),
            encode(name)
        );
        self.call::<Value>(Method::Delete, path, None).await?;
        Ok(())
    }

    pub async fn clone_snapshot(
        &self,
        volume: &str,
        snapshot: &str,
        name: &str,
    ) -> Result<VolumeJson, Failure> {
        let path = format!(
            "/api/v1/volumes/{}/snapshots/{}/clone",
            encode(volume),
            encode(snapshot)
        );
        let body = serde_json::json!({ "name": name });
        self.call(Method::Post, path, Some(body)).await
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn path_segments_keep_unreserved_characters_only() {
        assert_eq!(super::encode("pvc-1_a.b~"), "pvc-1_a.b~");
        assert_eq!(super::encode("a b/ü?"), "a%20b%2F%C3%BC%3F");
    }
}
