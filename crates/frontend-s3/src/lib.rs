//! keel-s3: the S3 frontend. HTTP/1.1 (hyper) → s3s (routing, XML, SigV4 in headers, presigned
//! URLs and streaming chunked payloads) → [`service::KeelS3`] → the object layer in
//! `keel_namespace::object` → the store.
//!
//! The `keel` binary wires it up with [`S3Frontend::open`], [`S3Frontend::ensure_initial_key`]
//! and [`S3Frontend::serve`]; `keel key …` and `keel bucket …` go through the admin methods of
//! [`S3Frontend`] (all blocking: call them from `spawn_blocking` in async code).
//!
//! Invariants: every request is signed by a known key and names only buckets the key owns or
//! was granted (unsigned requests may only list and read `public-read` buckets); accepted sockets use TCP_NODELAY (a GET's small
//! response must not wait for a delayed ACK); connections in flight are bounded by
//! [`CONNECTIONS_MAX`].

pub mod auth;
mod cors;
pub mod error;
pub mod ingest;
pub mod keys;
pub mod metrics;
pub mod policy;
pub mod read;
pub mod service;
pub mod token;
mod unread;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use keel_namespace::object::{
    parse_compression, BucketInfo, BucketRecord, GcReport, KeyRecord, Objects,
};
use keel_store::{Compression, Store};
use metrics::S3Metrics;
use s3s::config::{S3Config, StaticConfigProvider};
use s3s::service::{S3Service, S3ServiceBuilder};
use tokio::net::TcpListener;

pub use error::FrontendError;
pub use keel_namespace::object::ObjectError;

/// How chunks of buckets created over S3 are compressed.
pub const DEFAULT_BUCKET_COMPRESSION: Compression = Compression::Zstd;
/// Connections served at once; more wait in the listen backlog.
pub const CONNECTIONS_MAX: usize = 1024;
/// Largest XML request body (CompleteMultipartUpload with 10 000 parts, DeleteObjects with 1 000
/// keys of 1 KiB fit well below it).
pub const XML_BODY_SIZE_MAX_BYTES: usize = 4 << 20;
/// A browser-form (POST Object) upload's fields: each, and all together (the policy document
/// and its signature among them).
pub const FORM_SIZE_MAX_BYTES: usize = 64 << 10;
/// Largest file a browser-form upload carries: s3s reads it whole into memory before Keel
/// stores it, so it is bounded, and so are the uploads read at once ([`POST_UPLOADS_MAX`]).
/// Larger files: PUT or multipart upload.
pub const POST_FILE_SIZE_MAX_BYTES: usize = 32 << 20;
/// Browser-form uploads read at once; more wait.
pub const POST_UPLOADS_MAX: usize = 4;

/// Where the S3 layer spools request bodies of unknown length: a directory next to the store's
/// first data directory's files, on the same disk (never tmpfs); the files in it are unnamed.
fn spool_dir(objects: &keel_namespace::object::Objects) -> Option<std::path::PathBuf> {
    objects
        .store()
        .config()
        .data_dirs
        .first()
        .map(|dir| dir.join("s3-spool"))
}
/// A client must send a request's headers within this time (idle keep-alive connections too),
/// so slow or silent clients cannot hold the [`CONNECTIONS_MAX`] slots.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(60);
/// How long [`S3Frontend::serve`] waits for requests in flight after shutdown was asked for.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// An access key as listed (the secret is shown only when the key is created).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    pub access_key_id: String,
    pub name: String,
    pub created_unix_ms: i64,
}

/// The S3 frontend over one store. Cheap to clone.
#[derive(Clone)]
pub struct S3Frontend {
    objects: Arc<Objects>,
    metrics: S3Metrics,
    ops: keel_ops::Ops,
}

impl S3Frontend {
    /// Opens the object layer on `store`, with buckets and keys from the catalog. Blocking.
    pub fn open(
        store: Store,
        metadata: Arc<dyn keel_catalog::Metadata>,
    ) -> Result<S3Frontend, FrontendError> {
        Ok(S3Frontend::with_objects(Objects::open(store, metadata)?))
    }

    /// A frontend over an already opened object layer (e.g. with a cluster `ChunkStore`).
    pub fn with_objects(objects: Arc<Objects>) -> S3Frontend {
        S3Frontend {
            objects,
            metrics: S3Metrics::default(),
            ops: keel_ops::Ops::disabled(),
        }
    }

    /// Registers every request [`serve`] answers with `ops` (`keel ops`).
    pub fn with_ops(mut self, ops: keel_ops::Ops) -> S3Frontend {
        self.ops = ops;
        self
    }

    pub fn objects(&self) -> &Arc<Objects> {
        &self.objects
    }

    /// Per-bucket request metrics of [`serve`] (`docs/s3.md`).
    pub fn metrics(&self) -> &S3Metrics {
        &self.metrics
    }

    /// First start: makes sure a key exists. With `env_id` and `env_secret` (from
    /// `KEEL_ACCESS_KEY_ID` / `KEEL_SECRET_ACCESS_KEY`) that key is stored if missing (and its
    /// secret updated if it changed) and `None` is returned. Without them, when no key exists at
    /// all, a key named `initial` is generated and returned so the caller can print it once.
    pub fn ensure_initial_key(
        &self,
        env_id: Option<String>,
        env_secret: Option<String>,
    ) -> Result<Option<(String, String)>, FrontendError> {
        match (env_id, env_secret) {
            (Some(id), Some(secret)) => {
                keys::validate_access_key_id(&id)?;
                keys::validate_secret(&secret)?;
                match self.objects.key(&id) {
                    Some(existing) if existing.secret_access_key == secret => {}
                    Some(_) => {
                        self.objects.delete_key(&id)?;
                        self.import_key("initial", &id, &secret)?;
                    }
                    None => match self.import_key("initial", &id, &secret) {
                        // Another node of the cluster stored it meanwhile: fine if it is the
                        // same key (the refusal was applied here, so the catalog has it now).
                        Err(FrontendError::Object(ObjectError::AccessKeyExists(_)))
                            if self
                                .objects
                                .key(&id)
                                .is_some_and(|existing| existing.secret_access_key == secret) => {}
                        other => other?,
                    },
                }
                Ok(None)
            }
            _ => {
                if self.objects.list_keys().is_empty() {
                    Ok(Some(self.create_key("initial")?))
                } else {
                    Ok(None)
                }
            }
        }
    }

    /// Creates a key named `name`; returns (access key id, secret). The secret is not shown again.
    pub fn create_key(&self, name: &str) -> Result<(String, String), FrontendError> {
        let id = keys::new_access_key_id();
        let secret = keys::new_secret();
        self.import_key(name, &id, &secret)?;
        Ok((id, secret))
    }

    /// Stores a key whose id and secret the operator chose.
    pub fn import_key(&self, name: &str, id: &str, secret: &str) -> Result<(), FrontendError> {
        keys::validate_access_key_id(id)?;
        keys::validate_secret(secret)?;
        self.objects.add_key(KeyRecord {
            access_key_id: id.to_string(),
            name: name.to_string(),
            secret_access_key: secret.to_string(),
            created_unix_ms: keel_namespace::object::now_unix_ms(),
        })?;
        Ok(())
    }

    pub fn list_keys(&self) -> Vec<KeyInfo> {
        self.objects
            .list_keys()
            .into_iter()
            .map(|k| KeyInfo {
                access_key_id: k.access_key_id,
                name: k.name,
                created_unix_ms: k.created_unix_ms,
            })
            .collect()
    }

    pub fn delete_key(&self, access_key_id: &str) -> Result<(), FrontendError> {
        Ok(self.objects.delete_key(access_key_id)?)
    }

    /// Creates a bucket owned by `owner` (an access key id); `compression` is `none`, `lz4` or
    /// `zstd` (default).
    pub fn create_bucket(
        &self,
        name: &str,
        owner: &str,
        compression: Option<&str>,
    ) -> Result<(), FrontendError> {
        if self.objects.key(owner).is_none() {
            return Err(ObjectError::NoSuchAccessKey(owner.to_string()).into());
        }
        let compression = match compression {
            Some(name) => parse_compression(name)?,
            None => DEFAULT_BUCKET_COMPRESSION,
        };
        Ok(self.objects.create_bucket(name, owner, compression)?)
    }

    pub fn delete_bucket(&self, name: &str) -> Result<(), FrontendError> {
        Ok(self.objects.delete_bucket(name)?)
    }

    pub fn list_buckets(&self) -> Vec<BucketRecord> {
        self.objects.list_buckets()
    }

    /// Objects, bytes, estimated stored bytes and compression ratio of a bucket (O(objects)).
    pub fn bucket_info(&self, name: &str) -> Result<BucketInfo, FrontendError> {
        Ok(self.objects.bucket_info(name)?)
    }

    /// Lets `access_key_id` use `bucket` as its owner does.
    pub fn allow(&self, bucket: &str, access_key_id: &str) -> Result<(), FrontendError> {
        Ok(self.objects.allow(bucket, access_key_id)?)
    }

    pub fn deny(&self, bucket: &str, access_key_id: &str) -> Result<(), FrontendError> {
        Ok(self.objects.deny(bucket, access_key_id)?)
    }

    pub fn set_bucket_compression(
        &self,
        bucket: &str,
        compression: &str,
    ) -> Result<(), FrontendError> {
        Ok(self
            .objects
            .set_bucket_compression(bucket, parse_compression(compression)?)?)
    }

    /// Frees chunks nothing references (left by crashes or abandoned uploads). Blocking, O(chunks).
    pub fn collect_garbage(&self) -> Result<GcReport, FrontendError> {
        Ok(self.objects.collect_garbage()?)
    }

    /// The s3s service (a hyper and tower service), for callers that run their own server.
    pub fn service(&self) -> S3Service {
        let mut builder = S3ServiceBuilder::new(service::KeelS3 {
            objects: self.objects.clone(),
        });
        builder.set_auth(auth::KeyAuth {
            objects: self.objects.clone(),
        });
        builder.set_access(auth::BucketAccess {
            objects: self.objects.clone(),
        });
        let mut config = S3Config::default();
        config.xml_max_body_size = XML_BODY_SIZE_MAX_BYTES;
        // s3s reads a browser-form upload's file whole into memory: bounded in size here and in
        // number by `unread`.
        config.post_object_max_file_size = POST_FILE_SIZE_MAX_BYTES as u64;
        config.form_max_field_size = FORM_SIZE_MAX_BYTES;
        config.form_max_fields_size = FORM_SIZE_MAX_BYTES;
        builder.set_config(Arc::new(StaticConfigProvider::new(Arc::new(config))));
        builder.build()
    }

    /// Serves S3 on `listener` until `shutdown` completes, then stops accepting and waits up to
    /// [`SHUTDOWN_GRACE`] for requests in flight. Starts one garbage collection of orphaned
    /// chunks in the background.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> std::io::Result<()> {
        serve(listener, self, shutdown).await
    }
}

/// See [`S3Frontend::serve`].
pub async fn serve(
    listener: TcpListener,
    frontend: S3Frontend,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let service = unread::CloseOnUnreadBody {
        service: frontend.service(),
        metrics: frontend.metrics.clone(),
        ops: frontend.ops.clone(),
        objects: frontend.objects.clone(),
        form_uploads: Arc::new(tokio::sync::Semaphore::new(POST_UPLOADS_MAX)),
        peer: None,
        spool_dir: spool_dir(&frontend.objects).map(Arc::new),
    };
    // Free chunks orphaned by a crash or an abandoned upload, once per start, in the background
    // (safe beside live uploads: they pin what they rely on).
    let objects = frontend.objects.clone();
    tokio::task::spawn_blocking(move || match objects.collect_garbage() {
        Ok(report) if report.chunks_deleted > 0 => {
            tracing::info!(?report, "freed orphaned S3 chunks");
        }
        Ok(_) => {}
        Err(error) => tracing::warn!(%error, "S3 chunk garbage collection failed"),
    });
    let graceful = GracefulShutdown::new();
    let permits = Arc::new(tokio::sync::Semaphore::new(CONNECTIONS_MAX));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            _ = &mut shutdown => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!(%error, "accepting an S3 connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        if let Err(error) = stream.set_nodelay(true) {
            tracing::warn!(%error, %peer, "setting TCP_NODELAY failed");
        }
        let io = TokioIo::new(stream);
        let connection = hyper::server::conn::http1::Builder::new()
            .keep_alive(true)
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_READ_TIMEOUT)
            .serve_connection(
                io,
                unread::CloseOnUnreadBody {
                    peer: Some(peer),
                    ..service.clone()
                },
            );
        let watched = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = watched.await {
                tracing::debug!(%error, %peer, "S3 connection ended with an error");
            }
            drop(permit);
        });
    }
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(SHUTDOWN_GRACE) => {
            tracing::warn!("S3 requests still in flight after the shutdown grace period");
        }
    }
    Ok(())
}
