//! S3 load generator for `scripts/bench/s3.py`: N workers, each with its own keep-alive HTTP/1.1
//! connection, PUT or GET objects of one size through presigned SigV4 URLs (signed per request
//! with the rusty-s3 client library), timing every request in an HDR histogram. Prints one JSON
//! object with ops/s, MiB/s and latency percentiles.
//!
//! usage: s3load --endpoint URL --access-key ID --secret S --bucket B --op put|get
//!        --size BYTES --concurrency N --keys K [--duration-s S] [--ops-max N] [--prefix P]
//!
//! Keys are `<prefix>/<n>` with n in 0..K; GET reads keys an earlier PUT run wrote.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rusty_s3::{Bucket, Credentials, S3Action, UrlStyle};

/// Upper bound of a run, whatever the arguments say.
const DURATION_MAX: Duration = Duration::from_secs(300);

struct Args {
    endpoint: String,
    access_key: String,
    secret: String,
    bucket: String,
    op: String,
    size: usize,
    concurrency: usize,
    keys: u64,
    duration: Duration,
    ops_max: u64,
    prefix: String,
}

fn parse() -> Args {
    let mut args = Args {
        endpoint: String::new(),
        access_key: String::new(),
        secret: String::new(),
        bucket: String::new(),
        op: "put".into(),
        size: 4096,
        concurrency: 1,
        keys: 1000,
        duration: Duration::from_secs(5),
        ops_max: u64::MAX,
        prefix: "load".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().expect("every flag takes a value");
        match flag.as_str() {
            "--endpoint" => args.endpoint = value,
            "--access-key" => args.access_key = value,
            "--secret" => args.secret = value,
            "--bucket" => args.bucket = value,
            "--op" => args.op = value,
            "--size" => args.size = value.parse().expect("--size"),
            "--concurrency" => args.concurrency = value.parse().expect("--concurrency"),
            "--keys" => args.keys = value.parse().expect("--keys"),
            "--duration-s" => {
                args.duration = Duration::from_secs_f64(value.parse().expect("--duration-s"))
            }
            "--ops-max" => args.ops_max = value.parse().expect("--ops-max"),
            "--prefix" => args.prefix = value,
            other => panic!("unknown flag {other}"),
        }
    }
    args.duration = args.duration.min(DURATION_MAX);
    args
}

#[tokio::main]
async fn main() {
    let args = Arc::new(parse());
    let bucket = Arc::new(
        Bucket::new(
            args.endpoint.parse().expect("endpoint URL"),
            UrlStyle::Path,
            args.bucket.clone(),
            "us-east-1",
        )
        .expect("bucket"),
    );
    let credentials = Arc::new(Credentials::new(&args.access_key, &args.secret));
    let payload = Bytes::from(
        (0..args.size)
            .map(|i| (i * 7 + 13) as u8)
            .collect::<Vec<u8>>(),
    );
    let issued = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + args.duration;
    let mut workers = Vec::new();
    for _ in 0..args.concurrency {
        let (args, bucket, credentials, payload, issued) = (
            args.clone(),
            bucket.clone(),
            credentials.clone(),
            payload.clone(),
            issued.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut connector = HttpConnector::new();
            connector.set_nodelay(true);
            // One connection per worker: the pool never needs more.
            let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(1)
                .build(connector);
            let mut histogram = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).unwrap();
            let mut bytes = 0u64;
            let mut errors = 0u64;
            loop {
                let n = issued.fetch_add(1, Ordering::Relaxed);
                if n >= args.ops_max || Instant::now() >= deadline {
                    break;
                }
                let key = format!("{}/{}", args.prefix, n % args.keys);
                let begin = Instant::now();
                let request = if args.op == "put" {
                    let url = bucket
                        .put_object(Some(&credentials), &key)
                        .sign(Duration::from_secs(600));
                    hyper::Request::put(url.as_str())
                        .header("content-length", payload.len())
                        .body(Full::new(payload.clone()))
                        .unwrap()
                } else {
                    let url = bucket
                        .get_object(Some(&credentials), &key)
                        .sign(Duration::from_secs(600));
                    hyper::Request::get(url.as_str())
                        .body(Full::new(Bytes::new()))
                        .unwrap()
                };
                match client.request(request).await {
                    Ok(response) => {
                        let ok = response.status().is_success();
                        // Count the body frame by frame: collecting 64 MiB into one buffer
                        // would measure the client's memcpy, not the server.
                        let mut body = response.into_body();
                        let mut received = 0u64;
                        let mut failed = false;
                        while let Some(frame) = body.frame().await {
                            match frame {
                                Ok(frame) => {
                                    if let Some(data) = frame.data_ref() {
                                        received += data.len() as u64;
                                    }
                                }
                                Err(_) => {
                                    failed = true;
                                    break;
                                }
                            }
                        }
                        if !ok || failed {
                            errors += 1;
                            continue;
                        }
                        if args.op == "get" {
                            bytes += received;
                        }
                    }
                    Err(_) => {
                        errors += 1;
                        continue;
                    }
                }
                let micros = begin.elapsed().as_micros() as u64;
                histogram.record(micros.max(1)).unwrap();
                if args.op == "put" {
                    bytes += payload.len() as u64;
                }
            }
            (histogram, bytes, errors)
        }));
    }
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).unwrap();
    let mut bytes = 0u64;
    let mut errors = 0u64;
    for worker in workers {
        let (h, b, e) = worker.await.unwrap();
        histogram.add(h).unwrap();
        bytes += b;
        errors += e;
    }
    let seconds = started.elapsed().as_secs_f64();
    let ops = histogram.len();
    let result = serde_json::json!({
        "op": args.op,
        "size_bytes": args.size,
        "concurrency": args.concurrency,
        "ops": ops,
        "errors": errors,
        "seconds": seconds,
        "ops_per_s": ops as f64 / seconds,
        "mib_per_s": bytes as f64 / seconds / (1024.0 * 1024.0),
        "latency_us": {
            "min": histogram.min(),
            "p50": histogram.value_at_quantile(0.5),
            "p99": histogram.value_at_quantile(0.99),
            "p999": histogram.value_at_quantile(0.999),
            "max": histogram.max(),
        },
    });
    println!("{result}");
}
