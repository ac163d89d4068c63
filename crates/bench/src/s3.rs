//! S3 profiles: PUT then GET of small (4 KiB) or large (64 MiB) objects against a bucket.
//! Requests are signed with AWS SigV4 (presigned URLs from `rusty-s3`) and sent by a blocking
//! HTTP client (`ureq`) from `queue_depth` threads, each timing every request from send to the
//! last byte of the response.
//!
//! Invariants: memory stays bounded whatever the object size (one shared PUT body; GET bodies
//! are streamed through a fixed buffer and counted, never held); space used on the target is
//! bounded by reusing at most `OBJECTS_PER_WORKER_MAX` keys per worker, all deleted at the end;
//! a GET that returns a different length than was PUT is an error, not a number.

use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::{Rng, RngCore};
use rusty_s3::{Bucket, Credentials, S3Action, UrlStyle};

use crate::engine::QUEUE_DEPTH_MAX;
use crate::profile::{now_rfc3339, BenchResult, Profile, RunOptions};
use crate::stats::Recorder;
use crate::BenchError;

/// Object size of s3-small.
pub const SMALL_OBJECT_BYTES: usize = 4 * 1024;
/// Object size of s3-large.
pub const LARGE_OBJECT_BYTES: usize = 64 * 1024 * 1024;
/// Keys each worker cycles through (bounds the space a run uses).
const OBJECTS_PER_WORKER_MAX: u64 = 256;
/// Keys each worker cycles through for large objects.
const LARGE_OBJECTS_PER_WORKER_MAX: u64 = 2;
/// How long a presigned URL stays valid.
const SIGNATURE_VALIDITY: Duration = Duration::from_secs(3600);
/// Buffer through which GET bodies are streamed.
const READ_BUFFER_BYTES: usize = 256 * 1024;
/// Longest error body kept for a message.
const ERROR_BODY_MAX_BYTES: u64 = 4096;
/// Timeout for one request (a 64 MiB object on a slow link still fits).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// Endpoint and credentials of an S3 target.
#[derive(Clone, Debug, Default)]
pub struct S3Options {
    pub endpoint: Option<String>,
    pub access_key: Option<String>,
    pub secret_key: Option<String>,
    pub region: String,
}

struct Client {
    bucket: Bucket,
    credentials: Credentials,
    agent: ureq::Agent,
}

impl Client {
    fn new(options: &S3Options, bucket: &str) -> Result<Self, BenchError> {
        let invalid = |reason: String| BenchError::Invalid {
            what: "S3 options",
            reason,
        };
        let endpoint = options.endpoint.as_deref().ok_or_else(|| {
            invalid("no endpoint: pass --s3-endpoint or set AWS_ENDPOINT_URL".to_string())
        })?;
        let access_key = options.access_key.as_deref().ok_or_else(|| {
            invalid("no access key: pass --s3-access-key or set AWS_ACCESS_KEY_ID".to_string())
        })?;
        let secret_key = options.secret_key.as_deref().ok_or_else(|| {
            invalid("no secret key: pass --s3-secret-key or set AWS_SECRET_ACCESS_KEY".to_string())
        })?;
        let endpoint: url::Url = endpoint
            .parse()
            .map_err(|error| invalid(format!("endpoint {endpoint}: {error}")))?;
        let bucket = Bucket::new(
            endpoint,
            UrlStyle::Path,
            bucket.to_string(),
            options.region.clone(),
        )
        .map_err(|error| invalid(format!("bucket {bucket}: {error}")))?;
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(REQUEST_TIMEOUT))
            .build()
            .into();
        Ok(Self {
            bucket,
            credentials: Credentials::new(access_key, secret_key),
            agent,
        })
    }

    fn failure(operation: &'static str, key: &str, reason: String) -> BenchError {
        BenchError::S3 {
            operation,
            key: key.to_string(),
            reason,
        }
    }

    /// Reads a short error body for the message.
    fn error_text(response: &mut ureq::http::Response<ureq::Body>) -> String {
        let mut text = String::new();
        let _ = response
            .body_mut()
            .as_reader()
            .take(ERROR_BODY_MAX_BYTES)
            .read_to_string(&mut text);
        format!("HTTP {}: {}", response.status(), text.trim())
    }

    /// Creates the bucket; an existing bucket is fine.
    fn ensure_bucket(&self) -> Result<(), BenchError> {
        let action = self.bucket.create_bucket(&self.credentials);
        let url = action.sign(SIGNATURE_VALIDITY);
        let mut response = self
            .agent
            .put(url.as_str())
            .send(action.body())
            .map_err(|error| Self::failure("CreateBucket", "", error.to_string()))?;
        let status = response.status().as_u16();
        if response.status().is_success() || status == 409 {
            return Ok(());
        }
        Err(Self::failure(
            "CreateBucket",
            "",
            Self::error_text(&mut response),
        ))
    }

    fn put(&self, key: &str, body: &[u8]) -> Result<(), BenchError> {
        let url = self
            .bucket
            .put_object(Some(&self.credentials), key)
            .sign(SIGNATURE_VALIDITY);
        let mut response = self
            .agent
            .put(url.as_str())
            .send(body)
            .map_err(|error| Self::failure("PutObject", key, error.to_string()))?;
        if !response.status().is_success() {
            return Err(Self::failure(
                "PutObject",
                key,
                Self::error_text(&mut response),
            ));
        }
        // Drain the (empty) body so the connection can be reused.
        let _ = std::io::copy(&mut response.body_mut().as_reader(), &mut std::io::sink());
        Ok(())
    }

    /// GETs `key`, streaming the body through `buffer`; returns its length.
    fn get(&self, key: &str, buffer: &mut [u8]) -> Result<u64, BenchError> {
        let url = self
            .bucket
            .get_object(Some(&self.credentials), key)
            .sign(SIGNATURE_VALIDITY);
        let mut response = self
            .agent
            .get(url.as_str())
            .call()
            .map_err(|error| Self::failure("GetObject", key, error.to_string()))?;
        if !response.status().is_success() {
            return Err(Self::failure(
                "GetObject",
                key,
                Self::error_text(&mut response),
            ));
        }
        let mut reader = response.body_mut().with_config().limit(u64::MAX).reader();
        let mut total = 0u64;
        loop {
            let read = reader
                .read(buffer)
                .map_err(|error| Self::failure("GetObject", key, error.to_string()))?;
            if read == 0 {
                return Ok(total);
            }
            total += read as u64;
        }
    }

    fn delete(&self, key: &str) -> Result<(), BenchError> {
        let url = self
            .bucket
            .delete_object(Some(&self.credentials), key)
            .sign(SIGNATURE_VALIDITY);
        let mut response = self
            .agent
            .delete(url.as_str())
            .call()
            .map_err(|error| Self::failure("DeleteObject", key, error.to_string()))?;
        if !response.status().is_success() {
            return Err(Self::failure(
                "DeleteObject",
                key,
                Self::error_text(&mut response),
            ));
        }
        Ok(())
    }
}

fn key_of(run: u64, worker: usize, index: u64) -> String {
    format!("keel-bench/{run:016x}/{worker}/{index}")
}

/// Runs an S3 profile on `bucket`: a PUT phase for the first half of the runtime, then a GET
/// phase over the objects written, then the objects are deleted (untimed).
pub fn run(options: &RunOptions, bucket: &str) -> Result<Vec<BenchResult>, BenchError> {
    let (object_bytes, queue_depth_default, keys_per_worker) = match options.profile {
        Profile::S3Small => (SMALL_OBJECT_BYTES, 32, OBJECTS_PER_WORKER_MAX),
        Profile::S3Large => (LARGE_OBJECT_BYTES, 1, LARGE_OBJECTS_PER_WORKER_MAX),
        other => {
            return Err(BenchError::Internal {
                reason: format!("{} is not an S3 profile", other.name()),
            })
        }
    };
    let object_bytes = options.block_size_bytes.unwrap_or(object_bytes);
    let queue_depth = options.queue_depth.unwrap_or(queue_depth_default);
    if queue_depth == 0 || queue_depth > QUEUE_DEPTH_MAX {
        return Err(BenchError::Invalid {
            what: "queue depth",
            reason: format!("{queue_depth}; must be 1..={QUEUE_DEPTH_MAX}"),
        });
    }
    let client = Client::new(&options.s3, bucket)?;
    client.ensure_bucket()?;
    let mut body = vec![0u8; object_bytes];
    rand::thread_rng().fill_bytes(&mut body);
    let run_id: u64 = rand::thread_rng().gen();
    let phase_runtime = options.runtime / 2;
    let ops_max_per_phase = options.ops_max.map(|max| max.div_ceil(2));

    // PUT phase: each worker cycles through its keys; remembers how many it wrote.
    let put_started_at = now_rfc3339();
    let (puts, put_elapsed, written) = phase(
        queue_depth,
        phase_runtime,
        ops_max_per_phase,
        |worker, index| {
            let key = key_of(run_id, worker, index % keys_per_worker);
            client.put(&key, &body)?;
            Ok(object_bytes as u64)
        },
    )?;
    // GET phase: random keys among those each worker wrote.
    let get_started_at = now_rfc3339();
    let get_result = {
        let written = &written;
        phase(
            queue_depth,
            phase_runtime,
            ops_max_per_phase,
            |worker, _| {
                let count = written[worker].min(keys_per_worker);
                if count == 0 {
                    return Err(BenchError::Invalid {
                        what: "runtime",
                        reason: "too short: a worker wrote no object to read back".to_string(),
                    });
                }
                let key = key_of(run_id, worker, rand::thread_rng().gen_range(0..count));
                let mut buffer = vec![0u8; READ_BUFFER_BYTES.min(object_bytes.max(1))];
                let length = client.get(&key, &mut buffer)?;
                if length != object_bytes as u64 {
                    return Err(Client::failure(
                        "GetObject",
                        &key,
                        format!("returned {length} bytes, {object_bytes} were written"),
                    ));
                }
                Ok(length)
            },
        )
    };
    // Clean up whatever happened in the GET phase.
    for (worker, &count) in written.iter().enumerate() {
        for index in 0..count.min(keys_per_worker) {
            client.delete(&key_of(run_id, worker, index))?;
        }
    }
    let (gets, get_elapsed, _) = get_result?;

    let endpoint = options.s3.endpoint.clone().unwrap_or_default();
    let make = |operation: &str, recorder: &Recorder, elapsed: Duration, started_at: String| {
        let stats = recorder.summarise(elapsed);
        BenchResult {
            label: options
                .label
                .clone()
                .unwrap_or_else(|| options.target.clone()),
            profile: options.profile.name().to_string(),
            target: options.target.clone(),
            target_kind: "s3".to_string(),
            operation: operation.to_string(),
            engine: format!("{queue_depth} × ureq (SigV4 presigned) → {endpoint}"),
            direct_io: None,
            durability: "as the S3 server acknowledges a PUT".to_string(),
            block_size_bytes: object_bytes as u64,
            queue_depth,
            read_percent: if operation == "get" { 100 } else { 0 },
            elapsed_seconds: elapsed.as_secs_f64(),
            started_at,
            all: stats.clone(),
            reads: (operation == "get").then(|| stats.clone()),
            writes: (operation == "put").then_some(stats),
            storage: None,
            memory_backed: false,
            volatile_write_cache: None,
            warnings: vec![
                "remote target: the storage under the S3 server was not probed (run `keel bench \
                 probe` on the server's data directory)"
                    .to_string(),
            ],
        }
    };
    Ok(vec![
        make("put", &puts, put_elapsed, put_started_at),
        make("get", &gets, get_elapsed, get_started_at),
    ])
}

/// Runs `operation(worker, index)` from `workers` threads until `runtime` or `ops_max`; returns
/// the merged latencies, the elapsed time and how many ops each worker completed.
fn phase<F>(
    workers: usize,
    runtime: Duration,
    ops_max: Option<u64>,
    operation: F,
) -> Result<(Recorder, Duration, Vec<u64>), BenchError>
where
    F: Fn(usize, u64) -> Result<u64, BenchError> + Sync,
{
    let issued = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let deadline = start + runtime;
    let outcomes: Vec<Result<(Recorder, u64), BenchError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|worker| {
                let (issued, stop, operation) = (&issued, &stop, &operation);
                scope.spawn(move || {
                    let mut recorder = Recorder::new();
                    let mut index = 0u64;
                    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                        if ops_max.is_some_and(|max| issued.fetch_add(1, Ordering::Relaxed) >= max)
                        {
                            break;
                        }
                        let began = Instant::now();
                        match operation(worker, index) {
                            Ok(bytes) => recorder.record(began.elapsed(), bytes),
                            Err(error) => {
                                stop.store(true, Ordering::Relaxed);
                                return Err(error);
                            }
                        }
                        index += 1;
                    }
                    Ok((recorder, index))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| {
                handle.join().unwrap_or_else(|_| {
                    Err(BenchError::Internal {
                        reason: "an S3 worker thread panicked".to_string(),
                    })
                })
            })
            .collect()
    });
    let elapsed = start.elapsed();
    let mut merged = Recorder::new();
    let mut counts = Vec::with_capacity(workers);
    for outcome in outcomes {
        let (recorder, count) = outcome?;
        merged.merge(&recorder)?;
        counts.push(count);
    }
    Ok((merged, elapsed, counts))
}
