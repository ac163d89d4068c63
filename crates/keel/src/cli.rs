//! The management CLI: nouns and verbs (`keel volume create`, `keel snapshot send`, ...) that talk
//! to a running server's admin API. The token comes from `--token`, `KEEL_ADMIN_TOKEN`, or the
//! `admin-token` file in the data directory (`--data`, default ./keel-data).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use crate::config::{DEFAULT_ADMIN_ADDR, DEFAULT_DATA_DIR};
use crate::server::ADMIN_TOKEN_FILE;

/// How often `wait_job` polls a job's progress.
const JOB_POLL_INTERVAL: Duration = Duration::from_millis(200);

#[derive(clap::Args, Debug, Clone)]
pub struct Connection {
    /// Admin API address of the server.
    #[arg(long, env = "KEEL_ADMIN", default_value = DEFAULT_ADMIN_ADDR, global = true)]
    pub admin: String,
    /// Admin token (default: read from <data>/admin-token).
    #[arg(long, env = "KEEL_ADMIN_TOKEN", global = true, hide_env_values = true)]
    pub token: Option<String>,
    /// Data directory holding the admin token file.
    #[arg(long = "token-dir", default_value = DEFAULT_DATA_DIR, global = true)]
    pub token_dir: PathBuf,
}

impl Connection {
    /// The admin token: `--token`/`KEEL_ADMIN_TOKEN`, else the data directory's token file.
    pub fn token(&self) -> anyhow::Result<String> {
        if let Some(token) = &self.token {
            return Ok(token.clone());
        }
        let path = self.token_dir.join(ADMIN_TOKEN_FILE);
        std::fs::read_to_string(&path)
            .map(|t| t.trim().to_string())
            .with_context(|| {
                format!(
                    "reading the admin token from {} (pass --token or KEEL_ADMIN_TOKEN, or --token-dir DIR)",
                    path.display()
                )
            })
    }
}

/// An admin address as a URL base: `HOST:PORT` or a URL.
fn admin_base(address: &str) -> String {
    if address.starts_with("http") {
        address.trim_end_matches('/').to_string()
    } else {
        format!("http://{address}")
    }
}

pub struct Client {
    base: String,
    token: String,
    agent: ureq::Agent,
}

impl Client {
    pub fn connect(connection: &Connection) -> anyhow::Result<Client> {
        let token = connection.token()?;
        let base = admin_base(&connection.admin);
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .new_agent();
        Ok(Client { base, token, agent })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn bearer(&self) -> String {
        format!("Bearer {}", self.token)
    }

    fn decode<T: DeserializeOwned>(
        &self,
        response: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> anyhow::Result<T> {
        let mut response = response
            .map_err(|e| anyhow!("cannot reach the Keel admin API at {}: {e}", self.base))?;
        let status = response.status();
        let body: Value = response.body_mut().read_json().unwrap_or(Value::Null);
        if !status.is_success() {
            let message = body
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("no detail");
            bail!("{message} (HTTP {})", status.as_u16());
        }
        Ok(serde_json::from_value(body)?)
    }

    pub fn get<T: DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        let response = self
            .agent
            .get(self.url(path))
            .header("Authorization", self.bearer())
            .call();
        self.decode(response)
    }

    pub fn post<T: DeserializeOwned>(&self, path: &str, body: Value) -> anyhow::Result<T> {
        let response = self
            .agent
            .post(self.url(path))
            .header("Authorization", self.bearer())
            .send_json(body);
        self.decode(response)
    }

    pub fn delete<T: DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        let response = self
            .agent
            .delete(self.url(path))
            .header("Authorization", self.bearer())
            .call();
        self.decode(response)
    }

    /// Polls a job until it ends, drawing a progress line on a terminal.
    pub fn wait_job(&self, id: u64, what: &str) -> anyhow::Result<Value> {
        let tty = std::io::stderr().is_terminal();
        loop {
            let job: Value = self.get(&format!("/api/v1/jobs/{id}"))?;
            let done = job["done"].as_u64().unwrap_or(0);
            let total = job["total"].as_u64().unwrap_or(0);
            match job["state"].as_str() {
                Some("done") => {
                    if tty {
                        eprintln!("\r{what}: done ({done}/{total})          ");
                    }
                    return Ok(job["result"].clone());
                }
                Some("failed") => bail!(
                    "{what} failed: {}",
                    job["error"].as_str().unwrap_or("no detail")
                ),
                _ => {
                    if tty {
                        let percent = (done * 100).checked_div(total).unwrap_or(0);
                        eprint!("\r{what}: {done}/{total} ({percent}%)   ");
                    }
                    std::thread::sleep(JOB_POLL_INTERVAL);
                }
            }
        }
    }

    /// The same server API at another node's admin address, with this token (nodes started
    /// with one `--admin-token-file` share it; each has its own otherwise).
    fn at(&self, admin: &str) -> Client {
        Client {
            base: admin_base(admin),
            token: self.token.clone(),
            agent: self.agent.clone(),
        }
    }

    pub fn encode(segment: &str) -> String {
        segment
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect()
    }
}

/// Parses "10G", "512MiB", "4096" into bytes (binary units).
pub fn parse_size(text: &str) -> anyhow::Result<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .with_context(|| format!("size {text:?} has no number"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" | "kb" => 10,
        "m" | "mib" | "mb" => 20,
        "g" | "gib" | "gb" => 30,
        "t" | "tib" | "tb" => 40,
        other => bail!("unknown size unit {other:?} (use K, M, G or T)"),
    };
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| anyhow!("size {text:?} is too large"))
}

fn split_snapshot(spec: &str) -> anyhow::Result<(String, String)> {
    spec.split_once('@')
        .map(|(v, s)| (v.to_string(), s.to_string()))
        .filter(|(v, s)| !v.is_empty() && !s.is_empty())
        .ok_or_else(|| anyhow!("expected VOLUME@SNAPSHOT, got {spec:?}"))
}

fn print_json(value: &Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

pub(crate) fn human_bytes(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < units.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", units[unit])
    }
}

// ---------------------------------------------------------------------------------------------

#[derive(clap::Subcommand, Debug)]
pub enum VolumeCommand {
    /// Create a thin-provisioned volume.
    Create {
        name: String,
        /// Size, e.g. 10G.
        #[arg(long)]
        size: String,
        /// none, lz4 or zstd.
        #[arg(long, default_value = "none")]
        compression: String,
        /// Limit: operations per second.
        #[arg(long)]
        iops: Option<u64>,
        /// Limit: MiB per second (reads plus writes).
        #[arg(long)]
        mbps: Option<u64>,
        /// Replicas (1, 2 or 3) on distinct nodes, kept in sync: a FLUSH returns once every
        /// in-sync replica has the data durable.
        #[arg(long, default_value_t = 1)]
        replicas: u8,
    },
    /// List volumes.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Show a volume, its space use and snapshots.
    Info { name: String },
    /// Grow (or, with --allow-shrink, shrink) a volume.
    Resize {
        name: String,
        #[arg(long)]
        size: String,
        #[arg(long)]
        allow_shrink: bool,
    },
    /// Change a volume's replicas (R) or in-sync minimum, online, through its primary: new
    /// replicas are caught up in the background (`volume info` shows progress); removed ones
    /// erase their copy.
    SetReplication {
        name: String,
        /// Replicas wanted: 1, 2 or 3 (4 only as a move's first step: from 3 with --add-to).
        #[arg(long)]
        replicas: Option<u8>,
        /// Writes fail rather than go on with fewer replicas in sync than this (1 to R).
        #[arg(long)]
        min_in_sync: Option<u8>,
        /// Raising R: put the (first) new replica on this node (name or id) instead of where
        /// placement would.
        #[arg(long)]
        add_to: Option<String>,
        /// Lowering R: remove this node's replica (name or id; not the primary's) first.
        #[arg(long)]
        remove_from: Option<String>,
    },
    /// Move one replica of a volume to another node, online: a replica is added on --to and
    /// caught up while clients keep writing (R + 1 meanwhile), then, once it is in sync, the
    /// one on --from is removed. Any node can run it (the changes go through the volume's
    /// primary). Moving the primary's own replica hands the volume to the new one first: its
    /// clients then go on forwarded (attach them through a replica's node to read locally).
    /// An R=3 volume holds 4 replicas meanwhile, the only time R exceeds 3.
    Move {
        name: String,
        /// The node (name or id) whose replica leaves.
        #[arg(long)]
        from: String,
        /// The node (name or id) that gets a replica.
        #[arg(long)]
        to: String,
    },
    /// Make another replica, in sync, the volume's primary (through its primary, from any
    /// node): clients attached through the old primary's node go on forwarded to it.
    HandOff {
        name: String,
        /// The node (name or id) whose replica becomes the primary.
        #[arg(long)]
        to: String,
    },
    /// Compare a replicated volume's replicas block by block and repair what differs (run
    /// through its primary; stretches never written are skipped).
    Scrub { name: String },
    /// Delete a volume and its snapshots.
    Delete { name: String },
}

/// How often `keel volume move` looks at the new replica's catch-up.
const MOVE_POLL_INTERVAL: Duration = Duration::from_secs(1);
/// Without a terminal, `keel volume move` prints the catch-up's progress this often.
const MOVE_PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// The node ids a JSON array lists.
fn node_ids(list: &Value) -> Vec<u64> {
    (list.as_array().into_iter().flatten())
        .filter_map(Value::as_u64)
        .collect()
}

/// The cluster's members, as any node's `/api/v1/nodes` lists them (removed nodes left out).
fn members(client: &Client) -> anyhow::Result<Vec<Value>> {
    let nodes: Vec<Value> = client.get("/api/v1/nodes")?;
    Ok((nodes.into_iter().map(|node| node["record"].clone()))
        .filter(|record| record["removed"] != true)
        .collect())
}

/// The id and name of the member called `wanted` (a name or an id).
fn member(members: &[Value], wanted: &str) -> anyhow::Result<(u64, String)> {
    (members.iter())
        .find(|r| {
            r["name"].as_str() == Some(wanted)
                || r["id"].as_u64().is_some_and(|id| id.to_string() == wanted)
        })
        .and_then(|r| Some((r["id"].as_u64()?, r["name"].as_str()?.to_string())))
        .ok_or_else(|| anyhow!("node {wanted:?} is not a member of the cluster"))
}

/// The admin API of volume `name`'s primary, and its node id: any node's volume list names it.
fn primary_of(client: &Client, members: &[Value], name: &str) -> anyhow::Result<(Client, u64)> {
    let volumes: Vec<Value> = client.get("/api/v1/volumes")?;
    let listed = (volumes.iter())
        .find(|volume| volume["name"] == name)
        .ok_or_else(|| anyhow!("volume {name:?} not found"))?;
    let id = listed["primary"]
        .as_u64()
        .ok_or_else(|| anyhow!("volume {name:?} lists no primary"))?;
    (members.iter())
        .find(|r| r["id"].as_u64() == Some(id))
        .and_then(|r| r["addresses"]["admin"].as_str())
        .map(|admin| (client.at(admin), id))
        .ok_or_else(|| anyhow!("volume {name}'s primary has no admin address"))
}

/// `error` from volume `name`'s primary at `primary`, explained when it refused the token:
/// each node has its own admin token unless they share one.
fn token_refused(name: &str, primary: &Client, error: anyhow::Error) -> anyhow::Error {
    if error.to_string().ends_with("(HTTP 401)") {
        anyhow!(
            "volume {name}'s primary, at {}, refuses this admin token: run the command against \
             that node (--admin and its token), or give the nodes one token (keel server \
             --admin-token-file)",
            primary.base
        )
    } else {
        error
    }
}

/// `keel volume hand-off`: through the volume's primary, makes the replica on `to` (in sync)
/// the primary.
fn hand_off(client: &Client, name: &str, to: &str) -> anyhow::Result<()> {
    let members = members(client)?;
    let (to_id, to_name) = member(&members, to)?;
    let (at, from_id) = primary_of(client, &members, name)?;
    let handed: Value = at
        .post(
            &format!("/api/v1/volumes/{}/hand-off", Client::encode(name)),
            json!({ "to": to_id.to_string() }),
        )
        .map_err(|error| token_refused(name, &at, error))?;
    let from_name = member(&members, &from_id.to_string()).map_or(from_id.to_string(), |m| m.1);
    println!(
        "volume {name}: node {to_name} is its primary now (epoch {}); clients attached through \
         node {from_name} go on forwarded to it",
        handed["epoch"]
    );
    Ok(())
}

/// `keel volume move`: through the volume's primary, raises R with a replica on `to` (an
/// R=3 volume holds 4 meanwhile: `keel_catalog::REPLICAS_MOVING_MAX`), waits until it is in
/// sync (showing its catch-up's progress), hands the volume to it when `from` is the primary,
/// then lowers R removing `from`'s.
fn move_replica(client: &Client, name: &str, from: &str, to: &str) -> anyhow::Result<()> {
    let members = members(client)?;
    let (from_id, from_name) = member(&members, from)?;
    let (to_id, to_name) = member(&members, to)?;
    let path = format!("/api/v1/volumes/{}", Client::encode(name));
    let change = format!("{path}/replication");
    // The primary's own page has the replication as Raft records it and the catch-ups it runs.
    let primary = || primary_of(client, &members, name).map(|(at, _)| at);
    let replication = |primary: &Client| -> anyhow::Result<Value> {
        let info: Value =
            (primary.get(&path)).map_err(|error| token_refused(name, primary, error))?;
        Ok(info["replication"].clone())
    };
    let at = primary()?;
    let current = replication(&at)?;
    let factor = current["factor"].as_u64().unwrap_or(1);
    let replicas = node_ids(&current["replicas"]);
    if !replicas.contains(&from_id) {
        bail!(
            "node {from_name} holds no replica of volume {name} (its replicas: nodes {replicas:?})"
        );
    }
    if replicas.contains(&to_id) {
        bail!("node {to_name} holds a replica of volume {name} already");
    }
    if replicas.len() as u64 > factor {
        bail!(
            "volume {name} has a replica more than R already (a drain's copy under way): wait \
             until it ends"
        );
    }
    let _: Value = at
        .post(
            &change,
            json!({ "replicas": factor + 1, "add_to": to_id.to_string() }),
        )
        .map_err(|error| token_refused(name, &at, error))?;
    println!(
        "volume {name}: a replica added on node {to_name} (R {factor} -> {} until it is in sync)",
        factor + 1
    );
    let tty = std::io::stderr().is_terminal();
    let mut shown: Option<std::time::Instant> = None;
    let at = loop {
        // (The primary may change meanwhile: looked up each time.)
        let at = primary()?;
        let now = replication(&at)?;
        if !node_ids(&now["replicas"]).contains(&to_id) {
            bail!(
                "the new replica on node {to_name} was removed meanwhile (R lowered, or the node \
                 left): volume {name} keeps its replica on node {from_name}"
            );
        }
        if node_ids(&now["in_sync"]).contains(&to_id) {
            if tty {
                eprintln!();
            }
            break at;
        }
        let catching_up = (now["served_here"]["catching_up"]
            .as_array()
            .into_iter()
            .flatten())
        .find(|entry| entry["node"].as_u64() == Some(to_id));
        let line = match catching_up {
            Some(entry) => {
                let compared = entry["compared_bytes"].as_u64().unwrap_or(0);
                let total = entry["total_bytes"].as_u64().unwrap_or(0);
                let mut line = format!(
                    "catching up node {to_name}: {} of {} compared ({}%)",
                    human_bytes(compared),
                    human_bytes(total),
                    (compared * 100).checked_div(total).unwrap_or(0)
                );
                if let Some(eta) = entry["eta_seconds"].as_u64() {
                    line.push_str(&format!(", about {eta} s left"));
                }
                if entry["waiting_for_turn"] == true {
                    line.push_str(", waiting for a turn to copy the whole volume");
                }
                if let Some(failure) = entry["last_failure"].as_str() {
                    line.push_str(&format!("; last try failed: {failure}"));
                }
                line
            }
            None => format!("catching up node {to_name}: starting"),
        };
        if tty {
            eprint!("\r{line}   ");
        } else if shown.is_none_or(|shown| shown.elapsed() >= MOVE_PROGRESS_EVERY) {
            eprintln!("{line}");
            shown = Some(std::time::Instant::now());
        }
        std::thread::sleep(MOVE_POLL_INTERVAL);
    };
    // The primary's own replica: the new one, in sync, takes the volume over first.
    let at = if replication(&at)?["primary"].as_u64() == Some(from_id) {
        let handed: Result<Value, anyhow::Error> = at.post(
            &format!("{path}/hand-off"),
            json!({ "to": to_id.to_string() }),
        );
        handed.map_err(|error| {
            anyhow!(
                "{error}; the new replica on node {to_name} is in sync and volume {name} keeps \
                 R {}: end the move with `keel volume hand-off {name} --to {to_name}`, then \
                 `keel volume set-replication {name} --replicas {factor} --remove-from \
                 {from_name}`",
                factor + 1
            )
        })?;
        println!(
            "volume {name}: node {to_name} is its primary now; clients attached through node \
             {from_name} go on forwarded to it"
        );
        // Until the node the CLI asks has applied the hand-off, it names the old primary.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let (at, id) = primary_of(client, &members, name)?;
            if id == to_id || std::time::Instant::now() >= deadline {
                break at;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    } else {
        at
    };
    let lowered: Value = at
        .post(
            &change,
            json!({ "replicas": factor, "remove_from": from_id.to_string() }),
        )
        .map_err(|error| {
            anyhow!(
                "{error}; the new replica on node {to_name} is in sync and volume {name} keeps \
                 R {}: remove node {from_name}'s with `keel volume set-replication {name} \
                 --replicas {factor} --remove-from {from_name}`",
                factor + 1
            )
        })?;
    println!(
        "volume {name}: moved from node {from_name} to node {to_name}; replicas on nodes {}, in \
         sync: {}",
        lowered["replicas"], lowered["in_sync"]
    );
    Ok(())
}

pub fn volume(connection: &Connection, command: VolumeCommand) -> anyhow::Result<()> {
    let client = Client::connect(connection)?;
    match command {
        VolumeCommand::Create {
            name,
            size,
            compression,
            iops,
            mbps,
            replicas,
        } => {
            let created: Value = client.post(
                "/api/v1/volumes",
                json!({ "name": name, "size_bytes": parse_size(&size)?, "compression": compression,
                        "iops_max": iops, "bandwidth_max_mib_per_second": mbps,
                        "replicas": replicas }),
            )?;
            println!(
                "created volume {} ({})",
                name,
                human_bytes(created["size_bytes"].as_u64().unwrap_or(0))
            );
        }
        VolumeCommand::List { json } => {
            let volumes: Value = client.get("/api/v1/volumes")?;
            if json {
                return print_json(&volumes);
            }
            println!(
                "{:<24} {:>10} {:>6} {:>9} {:<20}",
                "NAME", "SIZE", "COMP", "SNAPSHOTS", "ORIGIN"
            );
            for v in volumes.as_array().into_iter().flatten() {
                println!(
                    "{:<24} {:>10} {:>6} {:>9} {:<20}",
                    v["name"].as_str().unwrap_or(""),
                    human_bytes(v["size_bytes"].as_u64().unwrap_or(0)),
                    v["compression"].as_str().unwrap_or(""),
                    v["snapshots"].as_u64().unwrap_or(0),
                    v["origin"].as_str().unwrap_or("-")
                );
            }
        }
        VolumeCommand::Info { name } => {
            let info: Value = client.get(&format!("/api/v1/volumes/{}", Client::encode(&name)))?;
            print_json(&info)?;
        }
        VolumeCommand::Resize {
            name,
            size,
            allow_shrink,
        } => {
            let _: Value = client.post(
                &format!("/api/v1/volumes/{}/resize", Client::encode(&name)),
                json!({ "size_bytes": parse_size(&size)?, "allow_shrink": allow_shrink }),
            )?;
            println!("resized volume {name} to {size}");
        }
        VolumeCommand::SetReplication {
            name,
            replicas,
            min_in_sync,
            add_to,
            remove_from,
        } => {
            if replicas.is_none() && min_in_sync.is_none() {
                return Err(anyhow!(
                    "nothing to change: give --replicas and/or --min-in-sync"
                ));
            }
            let changed: Value = client.post(
                &format!("/api/v1/volumes/{}/replication", Client::encode(&name)),
                json!({ "replicas": replicas, "in_sync_min": min_in_sync,
                        "add_to": add_to, "remove_from": remove_from }),
            )?;
            println!(
                "volume {name}: {} replica(s) on nodes {}, minimum {} in sync; in sync now: {}",
                changed["factor"], changed["replicas"], changed["in_sync_min"], changed["in_sync"]
            );
        }
        VolumeCommand::Move { name, from, to } => move_replica(&client, &name, &from, &to)?,
        VolumeCommand::HandOff { name, to } => hand_off(&client, &name, &to)?,
        VolumeCommand::Scrub { name } => {
            let started: Value = client.post(
                &format!("/api/v1/volumes/{}/scrub", Client::encode(&name)),
                json!({}),
            )?;
            let job = started["job"]
                .as_u64()
                .ok_or_else(|| anyhow!("server did not start a job"))?;
            let report = client.wait_job(job, &format!("scrubbing {name}"))?;
            print_json(&report)?;
        }
        VolumeCommand::Delete { name } => {
            let started: Value =
                client.delete(&format!("/api/v1/volumes/{}", Client::encode(&name)))?;
            let job = started["job"]
                .as_u64()
                .ok_or_else(|| anyhow!("server did not start a job"))?;
            client.wait_job(job, &format!("deleting {name}"))?;
            println!("deleted volume {name}");
        }
    }
    Ok(())
}

#[derive(clap::Subcommand, Debug)]
pub enum SnapshotCommand {
    /// Take an instant copy-on-write snapshot: VOLUME@SNAPSHOT.
    Create { spec: String },
    /// List a volume's snapshots with their space use.
    List {
        volume: String,
        #[arg(long)]
        json: bool,
    },
    /// Delete VOLUME@SNAPSHOT.
    Delete { spec: String },
    /// Make the volume's contents those of VOLUME@SNAPSHOT again.
    Rollback { spec: String },
    /// Create a writable volume NEW from VOLUME@SNAPSHOT.
    Clone { spec: String, new_volume: String },
    /// Write a send stream to stdout: full (VOL@B) or incremental (VOL@A VOL@B).
    Send {
        first: String,
        second: Option<String>,
    },
    /// Apply a send stream from stdin to VOLUME (on the server, or offline with --data).
    Receive {
        volume: String,
        /// Apply to this data directory directly (the server must not be running on it).
        #[arg(long = "offline-data")]
        offline_data: Option<PathBuf>,
    },
}

pub fn snapshot(connection: &Connection, command: SnapshotCommand) -> anyhow::Result<()> {
    if let SnapshotCommand::Receive {
        volume,
        offline_data: Some(dir),
    } = &command
    {
        return receive_offline(volume, dir);
    }
    let client = Client::connect(connection)?;
    match command {
        SnapshotCommand::Create { spec } => {
            let (volume, name) = split_snapshot(&spec)?;
            let _: Value = client.post(
                &format!("/api/v1/volumes/{}/snapshots", Client::encode(&volume)),
                json!({ "name": name }),
            )?;
            println!("created snapshot {spec}");
        }
        SnapshotCommand::List { volume, json } => {
            let snapshots: Value = client.get(&format!(
                "/api/v1/volumes/{}/snapshots",
                Client::encode(&volume)
            ))?;
            if json {
                return print_json(&snapshots);
            }
            println!(
                "{:<24} {:>10} {:>12} {:>12}  INCOMPLETE ON",
                "SNAPSHOT", "SIZE", "REFERENCED", "UNIQUE"
            );
            for s in snapshots.as_array().into_iter().flatten() {
                let incomplete: Vec<String> = s["incomplete_on"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|node| node.as_u64())
                    .map(|node| format!("node {node}"))
                    .collect();
                println!(
                    "{:<24} {:>10} {:>12} {:>12}  {}",
                    format!("{volume}@{}", s["name"].as_str().unwrap_or("")),
                    human_bytes(s["size_bytes"].as_u64().unwrap_or(0)),
                    human_bytes(s["referenced_bytes"].as_u64().unwrap_or(0)),
                    human_bytes(s["unique_bytes"].as_u64().unwrap_or(0)),
                    if incomplete.is_empty() {
                        "-".to_string()
                    } else {
                        incomplete.join(", ")
                    }
                );
            }
        }
        SnapshotCommand::Delete { spec } => {
            let (volume, name) = split_snapshot(&spec)?;
            let _: Value = client.delete(&format!(
                "/api/v1/volumes/{}/snapshots/{}",
                Client::encode(&volume),
                Client::encode(&name)
            ))?;
            println!("deleted snapshot {spec}");
        }
        SnapshotCommand::Rollback { spec } => {
            let (volume, name) = split_snapshot(&spec)?;
            let _: Value = client.post(
                &format!(
                    "/api/v1/volumes/{}/snapshots/{}/rollback",
                    Client::encode(&volume),
                    Client::encode(&name)
                ),
                json!({}),
            )?;
            println!("rolled {volume} back to {spec}");
        }
        SnapshotCommand::Clone { spec, new_volume } => {
            let (volume, name) = split_snapshot(&spec)?;
            let _: Value = client.post(
                &format!(
                    "/api/v1/volumes/{}/snapshots/{}/clone",
                    Client::encode(&volume),
                    Client::encode(&name)
                ),
                json!({ "name": new_volume }),
            )?;
            println!("cloned {spec} as {new_volume}");
        }
        SnapshotCommand::Send { first, second } => {
            let (volume, first_name) = split_snapshot(&first)?;
            let (base, target) = match second {
                Some(second) => {
                    let (second_volume, second_name) = split_snapshot(&second)?;
                    if second_volume != volume {
                        bail!("an incremental stream needs two snapshots of one volume");
                    }
                    (Some(first_name), second_name)
                }
                None => (None, first_name),
            };
            let mut path = format!(
                "/api/v1/volumes/{}/send?snapshot={}",
                Client::encode(&volume),
                Client::encode(&target)
            );
            if let Some(base) = base {
                path.push_str(&format!("&base={}", Client::encode(&base)));
            }
            if std::io::stdout().is_terminal() {
                bail!("refusing to write a binary stream to a terminal: redirect stdout (keel snapshot send ... > file)");
            }
            let response = client
                .agent
                .get(client.url(&path))
                .header("Authorization", client.bearer())
                .call()
                .map_err(|e| anyhow!("cannot reach the Keel admin API: {e}"))?;
            if !response.status().is_success() {
                let status = response.status();
                let body: Value = response.into_body().read_json().unwrap_or(Value::Null);
                bail!(
                    "{} (HTTP {})",
                    body["error"].as_str().unwrap_or("send failed"),
                    status.as_u16()
                );
            }
            let mut reader = response.into_body().into_reader();
            let copied = std::io::copy(&mut reader, &mut std::io::stdout().lock())
                .context("streaming to stdout")?;
            std::io::stdout().flush()?;
            eprintln!("sent {} ({} bytes)", target, copied);
        }
        SnapshotCommand::Receive { volume, .. } => {
            let mut stdin = std::io::stdin().lock();
            let response = client
                .agent
                .post(client.url(&format!(
                    "/api/v1/volumes/{}/receive",
                    Client::encode(&volume)
                )))
                .header("Authorization", client.bearer())
                .send(ureq::SendBody::from_reader(&mut stdin));
            let report: Value = client.decode(response)?;
            println!(
                "received into {volume}: {}",
                report["received"].as_str().unwrap_or("")
            );
        }
    }
    Ok(())
}

fn receive_offline(volume: &str, dir: &std::path::Path) -> anyhow::Result<()> {
    let store = keel_store::Store::open(keel_store::StoreConfig::new(vec![dir.to_path_buf()]))
        .with_context(|| format!("opening the store in {}", dir.display()))?;
    let catalog = keel_catalog::LocalCatalog::open(store.clone())?;
    if catalog.members() > 1 {
        anyhow::bail!(
            "{} belongs to a cluster of {} nodes: an offline receive would change its metadata \
             behind the cluster's back; receive through a running server (--admin ADDR) instead",
            dir.display(),
            catalog.members()
        );
    }
    let metadata: std::sync::Arc<dyn keel_catalog::Metadata> = std::sync::Arc::new(catalog);
    let volumes = keel_namespace::volume::VolumeManager::open(store, metadata)?;
    let mut stdin = std::io::stdin().lock();
    let report = volumes.receive(&mut stdin, volume)?;
    println!("received into {volume}: {report:?}");
    Ok(())
}

#[derive(clap::Subcommand, Debug)]
pub enum BucketCommand {
    /// Create a bucket owned by an access key (default: the first key).
    Create {
        name: String,
        #[arg(long)]
        owner: Option<String>,
        /// none, lz4 or zstd (default zstd).
        #[arg(long)]
        compression: Option<String>,
    },
    List {
        #[arg(long)]
        json: bool,
    },
    /// Objects, bytes, stored bytes and compression ratio of a bucket.
    Info {
        name: String,
    },
    Delete {
        name: String,
    },
    /// Let another access key use a bucket.
    Allow {
        name: String,
        access_key_id: String,
    },
}

pub fn bucket(connection: &Connection, command: BucketCommand) -> anyhow::Result<()> {
    let client = Client::connect(connection)?;
    match command {
        BucketCommand::Create {
            name,
            owner,
            compression,
        } => {
            let created: Value = client.post(
                "/api/v1/buckets",
                json!({ "name": name, "owner": owner, "compression": compression }),
            )?;
            println!(
                "created bucket {name} owned by {}",
                created["owner"].as_str().unwrap_or("?")
            );
        }
        BucketCommand::List { json } => {
            let buckets: Value = client.get("/api/v1/buckets")?;
            if json {
                return print_json(&buckets);
            }
            println!("{:<32} {:<24} {:<6}", "BUCKET", "OWNER", "COMP");
            for b in buckets.as_array().into_iter().flatten() {
                println!(
                    "{:<32} {:<24} {:<6}",
                    b["name"].as_str().unwrap_or(""),
                    b["owner"].as_str().unwrap_or(""),
                    b["compression"].as_str().unwrap_or("")
                );
            }
        }
        BucketCommand::Info { name } => {
            let info: Value = client.get(&format!("/api/v1/buckets/{}", Client::encode(&name)))?;
            print_json(&info)?;
        }
        BucketCommand::Delete { name } => {
            let _: Value = client.delete(&format!("/api/v1/buckets/{}", Client::encode(&name)))?;
            println!("deleted bucket {name}");
        }
        BucketCommand::Allow {
            name,
            access_key_id,
        } => {
            let _: Value = client.post(
                &format!("/api/v1/buckets/{}/allow", Client::encode(&name)),
                json!({ "access_key_id": access_key_id }),
            )?;
            println!("{access_key_id} may now use bucket {name}");
        }
    }
    Ok(())
}

#[derive(clap::Subcommand, Debug)]
pub enum KeyCommand {
    /// Create an access key; the secret is shown once.
    Create {
        name: String,
    },
    List {
        #[arg(long)]
        json: bool,
    },
    Delete {
        access_key_id: String,
    },
}

pub fn key(connection: &Connection, command: KeyCommand) -> anyhow::Result<()> {
    let client = Client::connect(connection)?;
    match command {
        KeyCommand::Create { name } => {
            let key: Value = client.post("/api/v1/keys", json!({ "name": name }))?;
            println!(
                "AWS_ACCESS_KEY_ID={}",
                key["access_key_id"].as_str().unwrap_or("")
            );
            println!(
                "AWS_SECRET_ACCESS_KEY={}",
                key["secret_access_key"].as_str().unwrap_or("")
            );
        }
        KeyCommand::List { json } => {
            let keys: Value = client.get("/api/v1/keys")?;
            if json {
                return print_json(&keys);
            }
            println!("{:<28} {:<24}", "ACCESS KEY ID", "NAME");
            for k in keys.as_array().into_iter().flatten() {
                println!(
                    "{:<28} {:<24}",
                    k["access_key_id"].as_str().unwrap_or(""),
                    k["name"].as_str().unwrap_or("")
                );
            }
        }
        KeyCommand::Delete { access_key_id } => {
            let _: Value =
                client.delete(&format!("/api/v1/keys/{}", Client::encode(&access_key_id)))?;
            println!("deleted key {access_key_id}");
        }
    }
    Ok(())
}

#[derive(clap::Subcommand, Debug)]
pub enum StoreCommand {
    /// Verify every live extent on every device and repair bad copies.
    Scrub,
    /// Collect garbage and reclaim the space of dead extents.
    Compact {
        /// Compact segments at least this dead (0.0-1.0).
        #[arg(long, default_value_t = 0.5)]
        dead_ratio: f64,
    },
}

pub fn store(connection: &Connection, command: StoreCommand) -> anyhow::Result<()> {
    let client = Client::connect(connection)?;
    let (path, body, what) = match command {
        StoreCommand::Scrub => ("/api/v1/store/scrub", json!({}), "scrub"),
        StoreCommand::Compact { dead_ratio } => (
            "/api/v1/store/compact",
            json!({ "dead_ratio_min": dead_ratio }),
            "compaction",
        ),
    };
    let started: Value = client.post(path, body)?;
    let job = started["job"]
        .as_u64()
        .ok_or_else(|| anyhow!("server did not start a job"))?;
    let result = client.wait_job(job, what)?;
    print_json(&result)?;
    if result["unrecoverable_extents"].as_u64().unwrap_or(0) > 0 {
        bail!("scrub found extents with no good copy");
    }
    Ok(())
}

pub fn status(connection: &Connection, json: bool) -> anyhow::Result<()> {
    let client = Client::connect(connection).or_else(|_| {
        // Status needs no token.
        Client::connect(&Connection {
            token: Some(String::new()),
            ..connection.clone()
        })
    })?;
    let report: Value = client.get("/api/v1/status")?;
    if json {
        return print_json(&report);
    }
    println!("{}", report["health"].as_str().unwrap_or("HEALTH_UNKNOWN"));
    for reason in report["reasons"].as_array().into_iter().flatten() {
        println!("  - {}", reason.as_str().unwrap_or(""));
    }
    let store = &report["store"];
    println!(
        "  data {} | {} volumes, {} buckets | live {} (x{:.2} compression), log {} in {} segments, free {}",
        report["data"].as_array().map(|d| d.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(", ")).unwrap_or_default(),
        report["volumes"], report["buckets"],
        human_bytes(store["live_raw_bytes"].as_u64().unwrap_or(0)),
        store["compression_ratio"].as_f64().unwrap_or(1.0),
        human_bytes(store["log_bytes"].as_u64().unwrap_or(0)),
        store["segments"],
        human_bytes(store["available_bytes"].as_u64().unwrap_or(0)),
    );
    let now = keel_clock::Clock::wall_unix_ms(&keel_clock::SystemClock);
    println!("  {}", scrub_line(&report["scrub"], now));
    Ok(())
}

/// What `keel ops` shows.
#[derive(clap::Args, Debug)]
pub struct OpsView {
    /// The slowest requests of the last 10 minutes (and how many were over the slow
    /// threshold) instead of those in flight.
    #[arg(long)]
    pub slow: bool,
    /// Show again every second until interrupted.
    #[arg(long)]
    pub watch: bool,
    /// The whole report as JSON (in flight, slowest, over the threshold).
    #[arg(long, conflicts_with = "watch")]
    pub json: bool,
    /// Show at most this many requests.
    #[arg(long, default_value_t = 20)]
    pub limit: usize,
}

pub fn ops(connection: &Connection, view: &OpsView) -> anyhow::Result<()> {
    let client = Client::connect(connection)?;
    loop {
        let report: Value = client.get("/api/v1/ops")?;
        if view.json {
            return print_json(&report);
        }
        if view.watch {
            // Clear the screen and go home, as watch(1) does.
            print!("\x1b[2J\x1b[H");
        }
        print!("{}", ops_table(&report, view));
        if !view.watch {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

/// The table `keel ops` prints.
fn ops_table(report: &Value, view: &OpsView) -> String {
    if report["tracking"] == Value::Bool(false) {
        return "request tracking is off (track_ops = false in the configuration)\n".to_string();
    }
    let (list, heading) = if view.slow {
        let over = report["over_threshold"].as_array().map_or(0, Vec::len);
        let heading = format!(
            "slowest of the last {}; {over} over {} ms kept",
            human_duration(report["window_seconds"].as_u64().unwrap_or(0)),
            report["slow_threshold_ms"].as_f64().unwrap_or(0.0),
        );
        (&report["slowest"], heading)
    } else {
        (&report["in_flight"], "in flight, oldest first".to_string())
    };
    let ops = list.as_array().map(Vec::as_slice).unwrap_or_default();
    let mut out = format!("{} requests {heading}\n", ops.len());
    if ops.is_empty() {
        return out;
    }
    out += &format!(
        "{:>10}  {:<4} {:<12} {:<36} {:<21} {}\n",
        if view.slow { "TOOK ms" } else { "AGE ms" },
        "API",
        "OP",
        "TARGET",
        "CLIENT",
        "PHASES (ms)"
    );
    for op in ops.iter().take(view.limit) {
        let current = op["phase"].as_str();
        let phases: Vec<String> = op["phases"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|phase| {
                let name = phase["phase"].as_str().unwrap_or("");
                let marker = if current == Some(name) { "*" } else { "" };
                format!("{marker}{name} {:.2}", phase["ms"].as_f64().unwrap_or(0.0))
            })
            .chain(
                op["waited_for"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|wait| {
                        format!(
                            "{} {:.2}",
                            wait["what"].as_str().unwrap_or(""),
                            wait["ms"].as_f64().unwrap_or(0.0)
                        )
                    }),
            )
            .collect();
        out += &format!(
            "{:>10.2}  {:<4} {:<12} {:<36} {:<21} {}\n",
            op["duration_ms"].as_f64().unwrap_or(0.0),
            op["frontend"].as_str().unwrap_or(""),
            op["operation"].as_str().unwrap_or(""),
            op["target"].as_str().unwrap_or(""),
            op["client"].as_str().unwrap_or("-"),
            phases.join(", "),
        );
    }
    if !view.slow && ops.iter().any(|op| op["phase"].is_string()) {
        out += "(* the phase it is in now)\n";
    }
    out
}

/// The scheduled scrubs as `keel status` shows them.
fn scrub_line(scrub: &Value, now_unix_ms: i64) -> String {
    let interval = scrub["interval_seconds"].as_u64().unwrap_or(0);
    if interval == 0 {
        return "scheduled scrubs off (scrub.interval_seconds = 0)".to_string();
    }
    let mut line = format!("scrub every {}", human_duration(interval));
    let last = &scrub["last"];
    match last["finished_unix_ms"].as_i64() {
        Some(finished) => {
            line += &format!(
                ", last {} ago ({} checked, {} repaired, {} unrecoverable, {} problems)",
                human_duration((now_unix_ms - finished).max(0) as u64 / 1000),
                human_bytes(last["bytes_checked"].as_u64().unwrap_or(0)),
                last["repaired_copies"].as_u64().unwrap_or(0)
                    + last["volume_blocks_repaired"].as_u64().unwrap_or(0),
                last["unrecoverable_extents"].as_u64().unwrap_or(0),
                last["errors"].as_array().map_or(0, Vec::len),
            )
        }
        None => line += ", none yet",
    }
    if let Some(next) = scrub["next_unix_ms"].as_i64() {
        line += &format!(
            ", next in {}",
            human_duration((next - now_unix_ms).max(0) as u64 / 1000)
        );
    }
    line
}

fn human_duration(seconds: u64) -> String {
    match seconds {
        s if s >= 86_400 => format!("{:.1}d", s as f64 / 86_400.0),
        s if s >= 3_600 => format!("{:.1}h", s as f64 / 3_600.0),
        s if s >= 60 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("10G").unwrap(), 10 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn snapshot_specs_need_both_parts() {
        assert_eq!(
            split_snapshot("db@nightly").unwrap(),
            ("db".into(), "nightly".into())
        );
        assert!(split_snapshot("db").is_err());
        assert!(split_snapshot("@x").is_err());
    }
}

// ---------------------------------------------------------------------------------------------
// Cluster and nodes.

#[derive(clap::Subcommand, Debug)]
pub enum ClusterCommand {
    /// The cluster: leader, term, every node and the health findings.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Print the join token other nodes need (`keel server --join ADDR --join-token TOKEN`).
    Token,
    /// Hand Raft leadership to a voter (by name or id), e.g. before maintenance on the
    /// leader's machine. Volumes keep their primaries.
    TransferLeader { node: String },
}

#[derive(clap::Subcommand, Debug)]
pub enum NodeCommand {
    /// Every node: state, role, voter or learner, last report, free space.
    List {
        #[arg(long)]
        json: bool,
    },
    /// One node (by name or id).
    Info { node: String },
    /// Move a node's voter seat (and, with replication, its data) elsewhere.
    Drain {
        node: String,
        /// Stop draining instead.
        #[arg(long)]
        undo: bool,
    },
    /// Remove a node from the cluster for good (its id is never reused). Refused while it holds
    /// volume replicas.
    Remove { node: String },
}

fn age(milliseconds: Option<u64>) -> String {
    match milliseconds {
        Some(ms) if ms < 10_000 => format!("{:.1}s ago", ms as f64 / 1000.0),
        Some(ms) => format!("{}s ago", ms / 1000),
        None => "never".to_string(),
    }
}

fn print_nodes(nodes: &[Value]) {
    println!(
        "{:<4} {:<16} {:<8} {:<8} {:<8} {:<9} {:<12} {:<22} {:<12} {:<12} FREE",
        "ID",
        "NAME",
        "ROLE",
        "STATE",
        "RAFT",
        "DRAINING",
        "HEARD",
        "CLUSTER ADDRESS",
        "PROVISIONED",
        "OF CAPACITY"
    );
    for node in nodes {
        let record = &node["record"];
        if record["removed"].as_bool().unwrap_or(false) {
            continue;
        }
        let liveness = &node["liveness"];
        let free: u64 = liveness["report"]["device_free_bytes"]
            .as_array()
            .map(|devices| devices.iter().filter_map(Value::as_u64).sum())
            .unwrap_or(0);
        let raft = format!(
            "{}{}",
            node["raft_role"].as_str().unwrap_or("?").to_lowercase(),
            if node["leader"].as_bool().unwrap_or(false) {
                "*"
            } else {
                ""
            }
        );
        let provisioned = node["provisioned_bytes"].as_u64().unwrap_or(0);
        let capacity: u64 = record["devices"]
            .as_array()
            .map(|devices| {
                devices
                    .iter()
                    .filter_map(|device| device["capacity_bytes"].as_u64())
                    .sum()
            })
            .unwrap_or(0);
        // Volumes are thin: the provisioned share may pass 100%.
        let share = if capacity == 0 {
            "-".to_string()
        } else {
            format!("{:.0}%", provisioned as f64 * 100.0 / capacity as f64)
        };
        println!(
            "{:<4} {:<16} {:<8} {:<8} {:<8} {:<9} {:<12} {:<22} {:<12} {:<12} {}",
            record["id"].as_u64().unwrap_or(0),
            record["name"].as_str().unwrap_or(""),
            record["role"].as_str().unwrap_or("").to_lowercase(),
            record["state"].as_str().unwrap_or("").to_lowercase(),
            raft,
            if record["draining"].as_bool().unwrap_or(false) {
                "yes"
            } else {
                "no"
            },
            age(liveness["last_report_ms_ago"].as_u64()),
            record["addresses"]["cluster"].as_str().unwrap_or(""),
            human_bytes(provisioned),
            share,
            match (
                liveness.is_null(),
                node["nearfull"].as_bool().unwrap_or(false)
            ) {
                (true, false) => "-".to_string(),
                (true, true) => "- (nearly full: no new replicas)".to_string(),
                (false, false) => human_bytes(free),
                (false, true) => format!("{} (nearly full: no new replicas)", human_bytes(free)),
            },
        );
    }
}

pub fn cluster(connection: &Connection, command: ClusterCommand) -> anyhow::Result<()> {
    let client = Client::connect(connection)?;
    match command {
        ClusterCommand::Status { json } => {
            let status: Value = client.get("/api/v1/cluster")?;
            if json {
                return print_json(&status);
            }
            println!(
                "cluster {} | this node {} | leader {} | term {}",
                status["cluster_id"].as_str().unwrap_or(""),
                status["node_id"],
                status["leader"]
                    .as_u64()
                    .map(|id| id.to_string())
                    .unwrap_or("none".into()),
                status["term"],
            );
            if status["membership_changing"].as_bool().unwrap_or(false) {
                println!("voters changing: the old and the new voters each need a majority until it ends");
            }
            print_nodes(status["nodes"].as_array().map(Vec::as_slice).unwrap_or(&[]));
            for check in status["health"].as_array().into_iter().flatten() {
                println!(
                    "  {} {}: {}\n      do: {}",
                    check["severity"].as_str().unwrap_or(""),
                    check["code"].as_str().unwrap_or(""),
                    check["message"].as_str().unwrap_or(""),
                    check["action"].as_str().unwrap_or("")
                );
            }
        }
        ClusterCommand::Token => {
            let token: Value = client.get("/api/v1/cluster/token")?;
            println!("{}", token["token"].as_str().unwrap_or(""));
        }
        ClusterCommand::TransferLeader { node } => {
            let answer: Value = client.post(
                "/api/v1/cluster/leader",
                serde_json::json!({ "node": node }),
            )?;
            println!(
                "node {} ({}) leads",
                answer["leader"],
                answer["name"].as_str().unwrap_or("")
            );
        }
    }
    Ok(())
}

pub fn node(connection: &Connection, command: NodeCommand) -> anyhow::Result<()> {
    let client = Client::connect(connection)?;
    match command {
        NodeCommand::List { json } => {
            let nodes: Value = client.get("/api/v1/nodes")?;
            if json {
                return print_json(&nodes);
            }
            print_nodes(nodes.as_array().map(Vec::as_slice).unwrap_or(&[]));
        }
        NodeCommand::Info { node } => {
            let info: Value = client.get(&format!("/api/v1/nodes/{}", Client::encode(&node)))?;
            print_json(&info)?;
        }
        NodeCommand::Drain { node, undo } => {
            let answer: Value = client.post(
                &format!("/api/v1/nodes/{}/drain", Client::encode(&node)),
                serde_json::json!({ "draining": !undo }),
            )?;
            let name = answer["node"].as_str().unwrap_or(&node);
            if undo {
                println!("node {name} no longer draining");
            } else {
                println!(
                    "node {name} draining: {} volume replica(s) to move off, each copied to \
                     another storage node first and removed here once the copy is in sync \
                     (keel node info {name} lists them, and any held there for a snapshot only \
                     it holds whole)",
                    answer["replicas"]
                );
                let primaries = answer["primaries"].as_u64().unwrap_or(0);
                if primaries > 0 {
                    println!(
                        "{primaries} of them primary: each is handed to another replica in \
                         sync first; clients attached to this node are then forwarded to it \
                         (slower): attach them through another node"
                    );
                }
                let single = answer["single_copies"].as_u64().unwrap_or(0);
                if single > 0 {
                    println!(
                        "{single} of them the volume's only copy (R=1): each is copied to \
                         another storage node that is up first (R stays 1), then handed to it; \
                         with no such node it stays"
                    );
                }
                let waiting = answer["waiting"]
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or(&[]);
                if !waiting.is_empty() {
                    println!(
                        "{} of them cannot move as things are (keel status shows it until they \
                         can):",
                        waiting.len()
                    );
                    for wait in waiting {
                        println!(
                            "  volume {}: {}",
                            wait["volume"].as_str().unwrap_or("?"),
                            wait["why"].as_str().unwrap_or("?")
                        );
                    }
                }
            }
        }
        NodeCommand::Remove { node } => {
            let answer: Value =
                client.delete(&format!("/api/v1/nodes/{}", Client::encode(&node)))?;
            println!(
                "removed node {} (id {}); its id will not be reused",
                answer["removed"].as_str().unwrap_or(&node),
                answer["id"]
            );
        }
    }
    Ok(())
}

/// `keel store rebuild-index`: offline, with the server stopped (the data directory lock
/// refuses otherwise).
pub fn rebuild_index(data: &[std::path::PathBuf]) -> anyhow::Result<()> {
    let config = keel_store::StoreConfig::new(data.to_vec());
    let started = std::time::Instant::now();
    let report = keel_store::Store::rebuild_index(&config, &mut |progress| {
        eprintln!("  segment {} of {}", progress.done, progress.total);
    })
    .with_context(|| format!("rebuilding the index of {}", data[0].display()))?;
    println!(
        "rebuilt the index from {} segments ({} extents read) in {:.1} s: {} live keys, {} \
         deleted keys held by tombstones",
        report.segments,
        report.extents_read,
        started.elapsed().as_secs_f64(),
        report.live_keys,
        report.tombstones
    );
    Ok(())
}

/// `keel cluster force-primary`: offline, on the survivor's stopped data directory.
pub fn force_primary(data: &std::path::Path, confirmed: bool) -> anyhow::Result<()> {
    if !confirmed {
        bail!(
            "force-primary makes this node the only metadata voter. Metadata changes that the \
             lost nodes committed and this node never received are LOST, and a lost node that \
             comes back must be wiped and joined again. Stop the server on {}, then run again \
             with --yes-i-accept-losing-metadata",
            data.display()
        );
    }
    let store = keel_store::Store::open(keel_store::StoreConfig::new(vec![data.to_path_buf()]))
        .with_context(|| format!("opening the store in {}", data.display()))?;
    let report = keel_cluster::force::force_primary(&store)?;
    store.flush()?;
    eprintln!(
        "WARNING: node {} is now the only voter (term {}, entry {}); it was one of {:?}.",
        report.node_id, report.term, report.index, report.previous_voters
    );
    eprintln!(
        "Start its server now. Wipe the data directory of any other former member before it \
         comes back, and join it anew."
    );
    Ok(())
}
