//! The CSI Node service: attach a Keel volume on this node as a block device, format and mount
//! it at the staging path, bind-mount it into pods.
//!
//! The device is the kernel NBD client's `/dev/nbdN` (driven through `nbd-client`) where the
//! kernel has the `nbd` module, and otherwise a loop device over the file nbdfuse exposes.
//! What is attached where is kept in `<state dir>/volumes/<volume>.json`, so a restarted plugin
//! finds its staged volumes again; a volume whose device vanished (a node reboot) is attached
//! anew when the CO stages it again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tonic::{Request, Response, Status};

use crate::admin::Admin;
use crate::check_capabilities;
use crate::proto::node_server::Node;
use crate::proto::node_service_capability::{rpc, Rpc};
use crate::proto::volume_capability::access_mode::Mode as AccessMode;
use crate::proto::volume_capability::AccessType;
use crate::proto::*;

/// How long nbdfuse may take to connect and expose the volume.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);
/// How long nbdfuse may take to exit once its mount is gone.
const DETACH_TIMEOUT: Duration = Duration::from_secs(10);
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// The topology key NodeGetInfo reports the node's name under.
pub const TOPOLOGY_NODE_KEY: &str = "topology.csi.keel.io/node";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMethod {
    /// The kernel NBD client where `/dev/nbd0` and `nbd-client` exist, else nbdfuse.
    Auto,
    Kernel,
    Nbdfuse,
}

#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// This node's id, as the CO knows it (the Kubernetes node name).
    pub node_id: String,
    /// The NBD endpoint of the Keel server on this node (`HOST:PORT`).
    pub nbd: String,
    /// Where the driver keeps what it attached (a real filesystem, kept across restarts).
    pub state_dir: PathBuf,
    pub attach: AttachMethod,
}

/// One staged volume, as recorded on disk.
#[derive(Serialize, Deserialize, Debug, Clone)]
struct Staged {
    volume: String,
    staging_path: PathBuf,
    /// "kernel" or "nbdfuse".
    method: String,
    device: PathBuf,
    /// nbdfuse's mount point (holding the file `nbd`) and its process.
    fuse_dir: Option<PathBuf>,
    fuse_pid: Option<i32>,
    block: bool,
    /// Target paths the volume is published at, with the access mode of each.
    published: BTreeMap<PathBuf, i32>,
}

pub struct NodeService {
    config: NodeConfig,
    admin: Admin,
    /// One node operation at a time: they are rare and each is a handful of commands.
    lock: Arc<tokio::sync::Mutex<()>>,
}

impl NodeService {
    pub fn new(mut config: NodeConfig, admin: Admin) -> anyhow::Result<NodeService> {
        std::fs::create_dir_all(config.state_dir.join("volumes"))?;
        std::fs::create_dir_all(config.state_dir.join("fuse"))?;
        // Absolute, so the paths recorded match what losetup and /proc report.
        config.state_dir = std::fs::canonicalize(&config.state_dir)?;
        Ok(NodeService {
            config,
            admin,
            lock: Arc::new(tokio::sync::Mutex::new(())),
        })
    }

    /// Runs blocking node work (commands, mounts) under the node lock.
    async fn locked<T, F>(&self, work: F) -> Result<T, Status>
    where
        F: FnOnce(&NodeConfig) -> Result<T, Status> + Send + 'static,
        T: Send + 'static,
    {
        let _guard = self.lock.lock().await;
        let config = self.config.clone();
        tokio::task::spawn_blocking(move || work(&config))
            .await
            .map_err(|error| Status::internal(format!("node task failed: {error}")))?
    }
}

fn state_path(config: &NodeConfig, volume: &str) -> PathBuf {
    config
        .state_dir
        .join("volumes")
        .join(format!("{volume}.json"))
}

fn load(config: &NodeConfig, volume: &str) -> Result<Option<Staged>, Status> {
    let path = state_path(config, volume);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|error| {
            Status::internal(format!(
                "{} is not a staging record: {error}",
                path.display()
            ))
        }),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(io_status(&path, error)),
    }
}

/// Writes the record whole (a new file renamed over the old one).
fn save(config: &NodeConfig, staged: &Staged) -> Result<(), Status> {
    let path = state_path(config, &staged.volume);
    let temporary = path.with_extension("json.new");
    let bytes = serde_json::to_vec_pretty(staged)
        .map_err(|error| Status::internal(format!("encoding the staging record: {error}")))?;
    std::fs::write(&temporary, bytes).map_err(|error| io_status(&temporary, error))?;
    std::fs::rename(&temporary, &path).map_err(|error| io_status(&path, error))
}

fn forget(config: &NodeConfig, volume: &str) -> Result<(), Status> {
    let path = state_path(config, volume);
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(io_status(&path, error)),
    }
}

fn io_status(path: &Path, error: std::io::Error) -> Status {
    Status::internal(format!("{}: {error}", path.display()))
}

/// Runs a command, answering its standard output; a failure carries its standard error.
fn run(program: &str, args: &[&str]) -> Result<String, Status> {
    let output = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|error| {
            if error.kind() == std::io::ErrorKind::NotFound {
                Status::failed_precondition(format!("{program} is not installed on this node"))
            } else {
                Status::internal(format!("running {program}: {error}"))
            }
        })?;
    if !output.status.success() {
        return Err(Status::internal(format!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// Mount points of this mount namespace (`/proc/self/mountinfo`, octal escapes undone).
fn mount_points() -> Result<Vec<PathBuf>, Status> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|error| io_status(Path::new("/proc/self/mountinfo"), error))?;
    Ok(text
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape_mountinfo(field)))
        .collect())
}

fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|digits| {
            std::str::from_utf8(digits)
                .ok()
                .and_then(|d| u8::from_str_radix(d, 8).ok())
        });
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn is_mount_point(path: &Path) -> Result<bool, Status> {
    let path = match std::fs::canonicalize(path) {
        Ok(path) => path,
        Err(_) => return Ok(false),
    };
    Ok(mount_points()?.contains(&path))
}

fn unmount_if_mounted(path: &Path) -> Result<(), Status> {
    if is_mount_point(path)? {
        run("umount", &[path_str(path)?])?;
    }
    Ok(())
}

/// The record of a volume staged on this node; NotFound when it is not.
fn staged_here(config: &NodeConfig, volume: &str) -> Result<Staged, Status> {
    load(config, volume)?
        .ok_or_else(|| Status::not_found(format!("volume {volume:?} is not staged on this node")))
}

fn path_str(path: &Path) -> Result<&str, Status> {
    path.to_str()
        .ok_or_else(|| Status::invalid_argument(format!("path {path:?} is not UTF-8")))
}

/// Whether `pid` is still the nbdfuse this driver started for `fuse_dir` (after a reboot the
/// number may belong to any process).
fn our_nbdfuse(pid: i32, fuse_dir: &Path) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<&[u8]> = cmdline.split(|byte| *byte == 0).collect();
    let fuse_dir = fuse_dir.as_os_str().as_encoded_bytes();
    args.first()
        .is_some_and(|program| program.ends_with(b"nbdfuse"))
        && args.contains(&fuse_dir)
}

/// The file a loop device reads, if it is attached.
fn loop_backing_file(device: &Path) -> Option<PathBuf> {
    let device = device.to_str()?;
    let file = run(
        "losetup",
        &["--noheadings", "--output", "BACK-FILE", device],
    )
    .ok()?;
    (!file.is_empty()).then(|| PathBuf::from(file))
}

/// Whether the device a record names is still attached, and still this volume's (after a
/// reboot it is not, and its loop device may serve another volume by then).
fn attached(staged: &Staged) -> bool {
    match staged.method.as_str() {
        "kernel" => staged
            .device
            .file_name()
            .is_some_and(|name| Path::new("/sys/block").join(name).join("pid").exists()),
        _ => match (&staged.fuse_dir, staged.fuse_pid) {
            (Some(fuse_dir), Some(pid)) => {
                our_nbdfuse(pid, fuse_dir)
                    && loop_backing_file(&staged.device) == Some(fuse_dir.join("nbd"))
            }
            _ => false,
        },
    }
}

fn use_kernel(config: &NodeConfig) -> bool {
    match config.attach {
        AttachMethod::Kernel => true,
        AttachMethod::Nbdfuse => false,
        AttachMethod::Auto => {
            Path::new("/dev/nbd0").exists()
                && Command::new("nbd-client")
                    .arg("--help")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok()
        }
    }
}

fn nbd_host_port(config: &NodeConfig) -> Result<(String, String), Status> {
    let (host, port) = config.nbd.rsplit_once(':').ok_or_else(|| {
        Status::failed_precondition(format!("NBD address {:?} has no port", config.nbd))
    })?;
    Ok((host.to_string(), port.to_string()))
}

/// Attaches a volume as a block device; the record returned says how, for detaching.
fn attach(
    config: &NodeConfig,
    admin: &Admin,
    volume: &str,
    staging_path: &Path,
    block: bool,
) -> Result<Staged, Status> {
    let mut staged = Staged {
        volume: volume.to_string(),
        staging_path: staging_path.to_path_buf(),
        method: String::new(),
        device: PathBuf::new(),
        fuse_dir: None,
        fuse_pid: None,
        block,
        published: BTreeMap::new(),
    };
    let (host, port) = nbd_host_port(config)?;
    // NBD clients report any refusal as a missing export; the Keel server keeps why. Its
    // last refusal now, so that only this attach's is reported (none known: any).
    let refusals_before = admin
        .refusals_blocking(volume, None)
        .ok()
        .map(|listing| listing.last);
    let refused = |status: Status| -> Status {
        match keel_refused(admin, volume, refusals_before) {
            Some(reason) => Status::new(
                status.code(),
                format!("{}; the Keel server refused: {reason}", status.message()),
            ),
            None => Status::new(
                status.code(),
                format!(
                    "{} (NBD clients do not pass on why the Keel server refused: its log on \
                     this node says, after \"refused to open an NBD export\")",
                    status.message()
                ),
            ),
        }
    };
    if use_kernel(config) {
        let device = (0..)
            .map(|n| format!("nbd{n}"))
            .take_while(|name| Path::new("/dev").join(name).exists())
            .find(|name| !Path::new("/sys/block").join(name).join("pid").exists())
            .ok_or_else(|| Status::resource_exhausted("every /dev/nbd* device is in use"))?;
        let device = format!("/dev/{device}");
        run("nbd-client", &["-N", volume, &host, &port, &device]).map_err(refused)?;
        staged.method = "kernel".into();
        staged.device = PathBuf::from(device);
        return Ok(staged);
    }
    let fuse_dir = config.state_dir.join("fuse").join(volume);
    std::fs::create_dir_all(&fuse_dir).map_err(|error| io_status(&fuse_dir, error))?;
    let pid_file = beside(&fuse_dir, "pid");
    let log_path = beside(&fuse_dir, "log");
    let _ = std::fs::remove_file(&pid_file);
    let log = std::fs::File::create(&log_path).map_err(|error| io_status(&log_path, error))?;
    let uri = format!("nbd://{host}:{port}/{volume}");
    let mut child = {
        use std::os::unix::process::CommandExt;
        Command::new("nbdfuse")
            .arg("-P")
            .arg(&pid_file)
            .arg(&fuse_dir)
            .arg(&uri)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            // Its own process group: it outlives a restart of the plugin.
            .process_group(0)
            .spawn()
            .map_err(|error| {
                Status::failed_precondition(format!(
                    "starting nbdfuse (Debian package libnbd-bin): {error}"
                ))
            })?
    };
    let pid = child.id() as i32;
    let file = fuse_dir.join("nbd");
    let deadline = Instant::now() + ATTACH_TIMEOUT;
    loop {
        if pid_file.exists() && file.exists() {
            break;
        }
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            return Err(refused(Status::unavailable(format!(
                "nbdfuse {uri} exited ({status}): {}",
                log.trim()
            ))));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Status::deadline_exceeded(format!(
                "nbdfuse did not expose {uri} within {ATTACH_TIMEOUT:?}"
            )));
        }
        std::thread::sleep(POLL_INTERVAL);
    }
    // Reap nbdfuse when it exits (at unstage), so it does not linger as a zombie.
    std::thread::spawn(move || child.wait());
    staged.method = "nbdfuse".into();
    staged.fuse_dir = Some(fuse_dir);
    staged.fuse_pid = Some(pid);
    let device = match run("losetup", &["--find", "--show", path_str(&file)?]) {
        Ok(device) => device,
        Err(status) => {
            detach(&staged);
            return Err(status);
        }
    };
    staged.device = PathBuf::from(device);
    Ok(staged)
}

/// Why the Keel server refused the attach of `volume` it recorded after refusal `after`, its
/// latest.
fn keel_refused(admin: &Admin, volume: &str, after: Option<u64>) -> Option<String> {
    match admin.refusals_blocking(volume, after) {
        Ok(listing) => listing
            .refusals
            .last()
            .map(|refusal| refusal.reason.clone()),
        Err(failure) => {
            tracing::info!(
                volume,
                error = failure.message,
                "cannot ask the Keel server why it refused"
            );
            None
        }
    }
}

/// `DIR.EXTENSION` next to nbdfuse's mount point (names may hold dots: no `with_extension`).
fn beside(fuse_dir: &Path, extension: &str) -> PathBuf {
    let mut name = fuse_dir.as_os_str().to_owned();
    name.push(".");
    name.push(extension);
    PathBuf::from(name)
}

/// Detaches the device a record names, as far as it is still there.
fn detach(staged: &Staged) {
    let device = staged.device.to_string_lossy().to_string();
    if staged.method == "kernel" {
        if let Err(status) = run("nbd-client", &["-d", &device]) {
            tracing::warn!(volume = %staged.volume, "detaching {device}: {}", status.message());
        }
        return;
    }
    let Some(fuse_dir) = &staged.fuse_dir else {
        return;
    };
    // Only our loop device: after a reboot the same number may serve another volume.
    if loop_backing_file(&staged.device) == Some(fuse_dir.join("nbd")) {
        if let Err(status) = run("losetup", &["-d", &device]) {
            tracing::warn!(volume = %staged.volume, "detaching {device}: {}", status.message());
        }
    }
    {
        let _ = run("fusermount3", &["-u", &fuse_dir.to_string_lossy()]);
        if let Some(pid) = staged.fuse_pid {
            let deadline = Instant::now() + DETACH_TIMEOUT;
            while our_nbdfuse(pid, fuse_dir) && Instant::now() < deadline {
                std::thread::sleep(POLL_INTERVAL);
            }
            if our_nbdfuse(pid, fuse_dir) {
                // SAFETY: signalling the nbdfuse process this driver started for this volume.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
        }
        let _ = std::fs::remove_dir(fuse_dir);
        for extension in ["pid", "log"] {
            let _ = std::fs::remove_file(beside(fuse_dir, extension));
        }
    }
}

fn device_size(device: &Path) -> Result<u64, Status> {
    let text = run("blockdev", &["--getsize64", path_str(device)?])?;
    text.parse()
        .map_err(|_| Status::internal(format!("blockdev answered {text:?} for a size")))
}

/// The filesystem on a device, or None when it holds none.
fn filesystem(device: &Path) -> Result<Option<String>, Status> {
    let output = Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "TYPE", path_str(device)?])
        .output()
        .map_err(|error| Status::failed_precondition(format!("running blkid: {error}")))?;
    match output.status.code() {
        Some(0) => Ok(Some(
            String::from_utf8_lossy(&output.stdout).trim().to_string(),
        )),
        // blkid's "nothing found".
        Some(2) => Ok(None),
        _ => Err(Status::internal(format!(
            "blkid {}: {}",
            device.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        ))),
    }
}

/// Grows an unmounted ext4 filesystem to its device, when the volume grew since it was last
/// staged (offline expansion: needs no CAP_SYS_RESOURCE, unlike growing it mounted).
fn grow_ext4_offline(device: &Path) -> Result<(), Status> {
    let device_bytes = device_size(device)?;
    let header = run("dumpe2fs", &["-h", path_str(device)?])?;
    let field = |name: &str| {
        header
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|value| value.trim().parse::<u64>().ok())
    };
    let (Some(blocks), Some(block_size)) = (field("Block count:"), field("Block size:")) else {
        return Err(Status::internal(format!(
            "dumpe2fs {} shows no block count and size",
            device.display()
        )));
    };
    if blocks.saturating_mul(block_size) + block_size > device_bytes {
        return Ok(());
    }
    // resize2fs wants a freshly checked filesystem; -p repairs only what is safe (exit 1).
    let check = Command::new("e2fsck")
        .args(["-f", "-p", path_str(device)?])
        .output()
        .map_err(|error| Status::failed_precondition(format!("running e2fsck: {error}")))?;
    if !matches!(check.status.code(), Some(0 | 1)) {
        return Err(Status::internal(format!(
            "e2fsck {} before growing it: {}",
            device.display(),
            String::from_utf8_lossy(&check.stdout).trim()
        )));
    }
    run("resize2fs", &[path_str(device)?])?;
    Ok(())
}

/// Formats the device when it holds nothing, then mounts it at the staging path.
fn format_and_mount(staged: &Staged, fs_type: &str, flags: &[String]) -> Result<(), Status> {
    let device = path_str(&staged.device)?;
    let fs_type = match filesystem(&staged.device)? {
        Some(existing) => {
            if existing == "ext4" {
                grow_ext4_offline(&staged.device)?;
            }
            existing
        }
        None => {
            let fs_type = if fs_type.is_empty() { "ext4" } else { fs_type };
            match fs_type {
                "xfs" => run("mkfs.xfs", &["-q", device])?,
                _ => run("mkfs.ext4", &["-q", "-F", device])?,
            };
            fs_type.to_string()
        }
    };
    std::fs::create_dir_all(&staged.staging_path)
        .map_err(|error| io_status(&staged.staging_path, error))?;
    let mut args = vec!["-t", fs_type.as_str()];
    let options = flags.join(",");
    if !options.is_empty() {
        args.extend(["-o", options.as_str()]);
    }
    args.extend([device, path_str(&staged.staging_path)?]);
    run("mount", &args)?;
    Ok(())
}

/// A volume id the node acts on: a Keel volume name (it names files in the state directory,
/// so nothing like `../x` may pass).
fn volume_id(value: &str) -> Result<String, Status> {
    let value = required(value, "volume_id")?;
    let valid = value.len() <= 128
        && !value.starts_with('.')
        && value
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.'));
    if !valid {
        return Err(Status::not_found(format!(
            "no volume {value:?}: Keel volume names are A-Z a-z 0-9 - _ . and do not start with a dot"
        )));
    }
    Ok(value.to_string())
}

fn required<'a>(value: &'a str, what: &str) -> Result<&'a str, Status> {
    if value.is_empty() {
        return Err(Status::invalid_argument(format!("{what} is required")));
    }
    Ok(value)
}

fn single_capability(capability: Option<&VolumeCapability>) -> Result<VolumeCapability, Status> {
    let capability = capability
        .cloned()
        .ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
    check_capabilities(std::slice::from_ref(&capability)).map_err(Status::invalid_argument)?;
    Ok(capability)
}

fn remove_target(target: &Path) -> Result<(), Status> {
    match std::fs::symlink_metadata(target) {
        Ok(meta) if meta.is_dir() => {
            std::fs::remove_dir(target).map_err(|error| io_status(target, error))
        }
        Ok(_) => std::fs::remove_file(target).map_err(|error| io_status(target, error)),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(io_status(target, error)),
    }
}

fn node_capability(kind: rpc::Type) -> NodeServiceCapability {
    NodeServiceCapability {
        r#type: Some(node_service_capability::Type::Rpc(Rpc {
            r#type: kind as i32,
        })),
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        request: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let request = request.into_inner();
        let volume = volume_id(&request.volume_id)?;
        let staging = PathBuf::from(required(
            &request.staging_target_path,
            "staging_target_path",
        )?);
        let capability = single_capability(request.volume_capability.as_ref())?;
        if self.admin.volume(&volume).await?.is_none() {
            return Err(Status::not_found(format!("volume {volume:?} not found")));
        }
        let admin = self.admin.clone();
        self.locked(move |config| {
            let (block, fs_type, flags) = match &capability.access_type {
                Some(AccessType::Mount(mount)) => {
                    (false, mount.fs_type.clone(), mount.mount_flags.clone())
                }
                _ => (true, String::new(), Vec::new()),
            };
            if let Some(existing) = load(config, &volume)? {
                if existing.staging_path != staging {
                    return Err(Status::failed_precondition(format!(
                        "volume {volume:?} is staged at {} already",
                        existing.staging_path.display()
                    )));
                }
                let mounted = existing.block || is_mount_point(&staging)?;
                if attached(&existing) && mounted {
                    return Ok(());
                }
                // What is left of a staging the node lost (a reboot, a crash mid-stage).
                if !existing.block {
                    unmount_if_mounted(&staging)?;
                }
                detach(&existing);
                forget(config, &volume)?;
            }
            let staged = attach(config, &admin, &volume, &staging, block)?;
            save(config, &staged)?;
            if !block {
                if let Err(status) = format_and_mount(&staged, &fs_type, &flags) {
                    detach(&staged);
                    forget(config, &volume)?;
                    return Err(status);
                }
            }
            Ok(())
        })
        .await?;
        Ok(Response::new(NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let request = request.into_inner();
        let volume = volume_id(&request.volume_id)?;
        let staging = PathBuf::from(required(
            &request.staging_target_path,
            "staging_target_path",
        )?);
        self.locked(move |config| {
            unmount_if_mounted(&staging)?;
            if let Some(staged) = load(config, &volume)? {
                detach(&staged);
                forget(config, &volume)?;
            }
            Ok(())
        })
        .await?;
        Ok(Response::new(NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let request = request.into_inner();
        let volume = volume_id(&request.volume_id)?;
        let target = PathBuf::from(required(&request.target_path, "target_path")?);
        let capability = single_capability(request.volume_capability.as_ref())?;
        required(&request.staging_target_path, "staging_target_path")?;
        let readonly = request.readonly;
        self.locked(move |config| {
            let mut staged = load(config, &volume)?.ok_or_else(|| {
                Status::failed_precondition(format!("volume {volume:?} is not staged on this node"))
            })?;
            let mode = capability.access_mode.as_ref().map_or(0, |m| m.mode);
            let single_writer = AccessMode::SingleNodeSingleWriter as i32;
            let elsewhere = staged.published.iter().find(|(path, existing)| {
                **path != target && (mode == single_writer || **existing == single_writer)
            });
            if let Some((path, _)) = elsewhere {
                return Err(Status::failed_precondition(format!(
                    "volume {volume:?} is published for a single writer at {} already",
                    path.display()
                )));
            }
            if is_mount_point(&target)? {
                return Ok(());
            }
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent).map_err(|error| io_status(parent, error))?;
            }
            let source = if staged.block {
                if !target.exists() {
                    std::fs::File::create(&target).map_err(|error| io_status(&target, error))?;
                }
                staged.device.clone()
            } else {
                std::fs::create_dir_all(&target).map_err(|error| io_status(&target, error))?;
                staged.staging_path.clone()
            };
            run("mount", &["--bind", path_str(&source)?, path_str(&target)?])?;
            if readonly {
                run("mount", &["-o", "remount,bind,ro", path_str(&target)?])?;
            }
            staged.published.insert(target, mode);
            save(config, &staged)
        })
        .await?;
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let request = request.into_inner();
        let volume = volume_id(&request.volume_id)?;
        let target = PathBuf::from(required(&request.target_path, "target_path")?);
        self.locked(move |config| {
            unmount_if_mounted(&target)?;
            remove_target(&target)?;
            if let Some(mut staged) = load(config, &volume)? {
                if staged.published.remove(&target).is_some() {
                    save(config, &staged)?;
                }
            }
            Ok(())
        })
        .await?;
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let request = request.into_inner();
        let volume = volume_id(&request.volume_id)?;
        let path = PathBuf::from(required(&request.volume_path, "volume_path")?);
        let usage = self
            .locked(move |config| {
                let staged = staged_here(config, &volume)?;
                let meta = std::fs::metadata(&path)
                    .map_err(|_| Status::not_found(format!("{} does not exist", path.display())))?;
                if staged.block || meta.file_type().is_file() {
                    let total = device_size(&staged.device)? as i64;
                    return Ok(vec![VolumeUsage {
                        total,
                        unit: volume_usage::Unit::Bytes as i32,
                        ..Default::default()
                    }]);
                }
                if path != staged.staging_path && !staged.published.contains_key(&path) {
                    return Err(Status::not_found(format!(
                        "volume {volume:?} is not mounted at {}",
                        path.display()
                    )));
                }
                statvfs_usage(&path)
            })
            .await?;
        Ok(Response::new(NodeGetVolumeStatsResponse { usage }))
    }

    async fn node_expand_volume(
        &self,
        request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let request = request.into_inner();
        let volume = volume_id(&request.volume_id)?;
        required(&request.volume_path, "volume_path")?;
        let wanted = request
            .capacity_range
            .as_ref()
            .map_or(0, |range| range.required_bytes.max(0) as u64);
        let capacity = self
            .locked(move |config| {
                let staged = staged_here(config, &volume)?;
                let size = device_size(&staged.device)?;
                if size < wanted {
                    return Err(Status::failed_precondition(format!(
                        "the device of {volume:?} has {size} bytes, less than {wanted}: it grows when the volume is staged again (offline expansion)"
                    )));
                }
                if !staged.block {
                    match filesystem(&staged.device)?.as_deref() {
                        Some("xfs") => run("xfs_growfs", &[path_str(&staged.staging_path)?])?,
                        _ => run("resize2fs", &[path_str(&staged.device)?])?,
                    };
                }
                Ok(size)
            })
            .await?;
        Ok(Response::new(NodeExpandVolumeResponse {
            capacity_bytes: capacity as i64,
        }))
    }

    async fn node_get_capabilities(
        &self,
        _request: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        let capabilities = [
            rpc::Type::StageUnstageVolume,
            rpc::Type::GetVolumeStats,
            rpc::Type::ExpandVolume,
            rpc::Type::SingleNodeMultiWriter,
        ]
        .into_iter()
        .map(node_capability)
        .collect();
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_info(
        &self,
        _request: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.config.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: Some(Topology {
                segments: [(TOPOLOGY_NODE_KEY.to_string(), self.config.node_id.clone())].into(),
            }),
        }))
    }
}

fn statvfs_usage(path: &Path) -> Result<Vec<VolumeUsage>, Status> {
    let c_path = std::ffi::CString::new(path_str(path)?)
        .map_err(|_| Status::invalid_argument("path holds a NUL byte"))?;
    // SAFETY: statvfs fills the zeroed struct; the path is a valid C string.
    let mut stats: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut stats) } != 0 {
        return Err(io_status(path, std::io::Error::last_os_error()));
    }
    let block = stats.f_frsize as i64;
    let bytes = VolumeUsage {
        available: stats.f_bavail as i64 * block,
        total: stats.f_blocks as i64 * block,
        used: (stats.f_blocks as i64 - stats.f_bfree as i64) * block,
        unit: volume_usage::Unit::Bytes as i32,
    };
    let inodes = VolumeUsage {
        available: stats.f_favail as i64,
        total: stats.f_files as i64,
        used: stats.f_files as i64 - stats.f_ffree as i64,
        unit: volume_usage::Unit::Inodes as i32,
    };
    Ok(vec![bytes, inodes])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_ids_cannot_leave_the_state_directory() {
        assert_eq!(volume_id("pvc-1.data").ok().as_deref(), Some("pvc-1.data"));
        for bad in ["../etc", "a/b", ".hidden", "", "x\0y"] {
            assert!(volume_id(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            volume_id("").map_err(|s| s.code()).err(),
            Some(tonic::Code::InvalidArgument)
        );
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mountinfo("/var/tmp/a\\040b"), "/var/tmp/a b");
        assert_eq!(unescape_mountinfo("/x\\134y"), "/x\\y");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        assert_eq!(unescape_mountinfo("/trailing\\"), "/trailing\\");
    }
}
