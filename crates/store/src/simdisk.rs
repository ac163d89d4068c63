//! A simulated disk for tests: the store runs on it unchanged (through [`Disk`]), and the test
//! decides what a crash, a failing device or cosmic rays do.
//!
//! Model (what a Linux filesystem on a disk with a volatile cache guarantees, and no more):
//! - every file has *durable* bytes (what survives a power cut) and *current* bytes (what reads
//!   see: the page cache). A write changes current bytes and is queued as unsynced; `sync_data`
//!   makes the file's queued writes durable, in order.
//! - directory entries (create, rename, remove) change the current directory and become durable
//!   at `sync_dir` of that directory.
//! - [`SimDisk::power_cut`] gives the disk as it comes back: durable directory entries (or, per
//!   directory, all current ones: a journal may have committed them), durable file bytes, and
//!   each unsynced write independently dropped, kept, or torn at a 512-byte sector boundary.
//! - an injected sync failure behaves like Linux after a writeback error: the file's queued
//!   writes are never made durable (they stay in the page cache, so reads still see them), and
//!   the *next* sync of the file reports success. Exactly the trap a store must not fall into.
//! - [`SimDisk::drop_caches`] (a process restart without power loss reading through
//!   `DiskFile::drop_cache`) shows the durable bytes plus the writes still queued.
//! - a capacity makes writes fail with ENOSPC; bit flips change durable and current bytes.
//!
//! Deterministic: randomness comes from a seed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::disk::{DirLock, Disk, DiskFile, OpenMode};

/// Size of the unit a torn write keeps or loses.
pub const SECTOR_BYTES: usize = 512;

/// Which operation an injected fault hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOp {
    Read,
    Write,
    Sync,
    SyncDir,
    Rename,
    Create,
}

#[derive(Debug, Clone)]
struct Fault {
    op: FaultOp,
    /// Only paths containing this.
    path_contains: String,
    errno: i32,
    /// Operations of this kind on matching paths to let through first.
    skip: u32,
    /// How many to fail.
    count: u32,
}

/// A queued, unsynced change to a file.
#[derive(Debug, Clone)]
enum Pending {
    Write { offset: u64, data: Vec<u8> },
    SetLen(u64),
}

#[derive(Debug, Default, Clone)]
struct FileState {
    durable: Vec<u8>,
    current: Vec<u8>,
    pending: Vec<Pending>,
}

#[derive(Debug, Default, Clone)]
struct DirState {
    current: BTreeMap<String, u64>,
    durable: BTreeMap<String, u64>,
}

#[derive(Debug, Default)]
struct State {
    files: HashMap<u64, FileState>,
    dirs: BTreeMap<PathBuf, DirState>,
    next_file: u64,
    locks: HashSet<PathBuf>,
    capacity_bytes: Option<u64>,
    faults: Vec<Fault>,
    /// Faults that fired, for tests to assert on.
    fired: Vec<(FaultOp, PathBuf)>,
    /// Every file created, in order.
    created: Vec<PathBuf>,
    /// Reads of file contents so far, per path.
    reads: BTreeMap<PathBuf, u64>,
    /// Each write to paths containing this takes this long (a device slow for some files).
    slow: Option<(String, std::time::Duration)>,
    /// Bytes written by direct writes (`DiskFile::write_direct_at`) so far.
    direct_bytes: u64,
    /// Direct writes fail with `Unsupported`, as on a filesystem without `O_DIRECT`.
    refuse_direct: bool,
    rng: u64,
}

impl State {
    fn random(&mut self) -> u64 {
        // xorshift64*
        let mut x = self.rng.max(1);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn used_bytes(&self) -> u64 {
        self.files
            .values()
            .map(|file| file.current.len().max(file.durable.len()) as u64)
            .sum()
    }

    fn fault(&mut self, op: FaultOp, path: &Path) -> io::Result<()> {
        let text = path.to_string_lossy();
        for fault in self.faults.iter_mut() {
            if fault.op != op || fault.count == 0 || !text.contains(&fault.path_contains) {
                continue;
            }
            if fault.skip > 0 {
                fault.skip -= 1;
                continue;
            }
            fault.count -= 1;
            let errno = fault.errno;
            self.fired.push((op, path.to_path_buf()));
            return Err(io::Error::from_raw_os_error(errno));
        }
        Ok(())
    }

    fn entry(&self, path: &Path) -> Option<u64> {
        let dir = path.parent()?;
        let name = path.file_name()?.to_string_lossy().into_owned();
        self.dirs.get(dir)?.current.get(&name).copied()
    }
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{} not found", path.display()),
    )
}

fn split(path: &Path) -> io::Result<(PathBuf, String)> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no parent directory"))?;
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no file name"))?;
    Ok((dir.to_path_buf(), name.to_string_lossy().into_owned()))
}

/// A simulated disk. Cheap to clone; clones share the disk.
#[derive(Clone)]
pub struct SimDisk {
    state: Arc<Mutex<State>>,
}

impl fmt::Debug for SimDisk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SimDisk")
    }
}

impl SimDisk {
    pub fn new(seed: u64) -> SimDisk {
        SimDisk {
            state: Arc::new(Mutex::new(State {
                rng: seed ^ 0x9E37_79B9_7F4A_7C15,
                ..State::default()
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Writes beyond this many bytes in all files fail with ENOSPC.
    pub fn set_capacity(&self, bytes: Option<u64>) {
        self.lock().capacity_bytes = bytes;
    }

    /// Bytes all files hold now (what [`SimDisk::set_capacity`] counts).
    pub fn used_bytes(&self) -> u64 {
        self.lock().used_bytes()
    }

    /// Fails `count` operations of kind `op` on paths containing `path_contains`, after letting
    /// `skip` of them through, with `errno` (e.g. `libc::EIO`, `libc::ENOSPC`).
    pub fn inject(&self, op: FaultOp, path_contains: &str, errno: i32, skip: u32, count: u32) {
        self.lock().faults.push(Fault {
            op,
            path_contains: path_contains.to_string(),
            errno,
            skip,
            count,
        });
    }

    /// Every file created so far, in order.
    pub fn created(&self) -> Vec<PathBuf> {
        self.lock().created.clone()
    }

    /// Makes each write to a path containing `path_contains` take `delay` (`None`: none do).
    pub fn slow_writes(&self, path_contains: Option<&str>, delay: std::time::Duration) {
        self.lock().slow = path_contains.map(|path| (path.to_string(), delay));
    }

    /// Bytes written around the page cache so far (what `O_DIRECT` would have written).
    pub fn direct_bytes(&self) -> u64 {
        self.lock().direct_bytes
    }

    /// Refuse direct writes from now on, as a filesystem without `O_DIRECT` does.
    pub fn refuse_direct(&self) {
        self.lock().refuse_direct = true;
    }

    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// Reads of the contents of files whose path contains `path_contains` so far (each
    /// `read_at`, failed ones included).
    pub fn reads(&self, path_contains: &str) -> u64 {
        self.lock()
            .reads
            .iter()
            .filter(|(path, _)| path.to_string_lossy().contains(path_contains))
            .map(|(_, count)| count)
            .sum()
    }

    /// Faults that fired so far.
    pub fn fired(&self) -> Vec<(FaultOp, PathBuf)> {
        self.lock().fired.clone()
    }

    /// Flips one bit of a file, in its durable and current bytes.
    pub fn flip_bit(&self, path: &Path, offset: u64, bit: u8) -> io::Result<()> {
        let mut state = self.lock();
        let id = state.entry(path).ok_or_else(|| not_found(path))?;
        let file = state.files.get_mut(&id).ok_or_else(|| not_found(path))?;
        for bytes in [&mut file.durable, &mut file.current] {
            if let Some(byte) = bytes.get_mut(offset as usize) {
                *byte ^= 1 << (bit % 8);
            }
        }
        Ok(())
    }

    /// The length of a file's current bytes.
    pub fn len_of(&self, path: &Path) -> Option<u64> {
        let state = self.lock();
        let id = state.entry(path)?;
        state.files.get(&id).map(|file| file.current.len() as u64)
    }

    /// Names in a directory (current view).
    pub fn list(&self, dir: &Path) -> Vec<String> {
        self.lock()
            .dirs
            .get(dir)
            .map(|d| d.current.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// The disk after a power cut: a new, independent disk (the old one keeps its state, so a
    /// test can cut the same moment several ways). Locks are released, faults kept.
    pub fn power_cut(&self) -> SimDisk {
        let mut state = self.lock();
        let mut files: HashMap<u64, FileState> = HashMap::new();
        // In file order: the random fates are drawn in the same order at every run of a seed.
        let mut ids: Vec<u64> = state.files.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let Some(file) = state.files.get(&id).cloned() else {
                continue;
            };
            let mut bytes = file.durable.clone();
            for pending in &file.pending {
                match pending {
                    Pending::SetLen(len) => {
                        if state.random().is_multiple_of(2) {
                            bytes.resize(*len as usize, 0);
                        }
                    }
                    Pending::Write { offset, data } => {
                        let keep = match state.random() % 3 {
                            0 => 0,
                            1 => data.len(),
                            _ => {
                                let sectors = data.len().div_ceil(SECTOR_BYTES);
                                let kept = (state.random() as usize) % (sectors + 1);
                                (kept * SECTOR_BYTES).min(data.len())
                            }
                        };
                        if keep > 0 {
                            let start = *offset as usize;
                            if bytes.len() < start + keep {
                                bytes.resize(start + keep, 0);
                            }
                            bytes[start..start + keep].copy_from_slice(&data[..keep]);
                        }
                    }
                }
            }
            files.insert(
                id,
                FileState {
                    durable: bytes.clone(),
                    current: bytes,
                    pending: Vec::new(),
                },
            );
        }
        let mut dirs = BTreeMap::new();
        let dir_paths: Vec<PathBuf> = state.dirs.keys().cloned().collect();
        for path in dir_paths {
            let Some(dir) = state.dirs.get(&path).cloned() else {
                continue;
            };
            // A journal commits directory changes in order: all of them made it, or none since
            // the last sync_dir.
            let entries = if state.random().is_multiple_of(2) {
                dir.durable.clone()
            } else {
                dir.current.clone()
            };
            dirs.insert(
                path,
                DirState {
                    current: entries.clone(),
                    durable: entries,
                },
            );
        }
        successor(&mut state, files, dirs)
    }

    /// The disk as a restarted process sees it without power loss: current bytes are what the
    /// page cache holds, minus writes whose writeback failed (they are clean pages that never
    /// reached the disk and a re-read after dropping caches shows the disk's bytes).
    pub fn process_restart(&self) -> SimDisk {
        let mut state = self.lock();
        let files = state
            .files
            .iter()
            .map(|(id, file)| (*id, file.clone()))
            .collect();
        let dirs = state.dirs.clone();
        successor(&mut state, files, dirs)
    }
}

/// A new disk holding `files` and `dirs`, with `state`'s capacity and faults, no locks held.
fn successor(
    state: &mut State,
    files: HashMap<u64, FileState>,
    dirs: BTreeMap<PathBuf, DirState>,
) -> SimDisk {
    let rng = state.random();
    SimDisk {
        state: Arc::new(Mutex::new(State {
            files,
            dirs,
            next_file: state.next_file,
            locks: HashSet::new(),
            capacity_bytes: state.capacity_bytes,
            faults: state.faults.clone(),
            fired: Vec::new(),
            created: Vec::new(),
            reads: BTreeMap::new(),
            slow: None,
            direct_bytes: 0,
            refuse_direct: state.refuse_direct,
            rng,
        })),
    }
}

#[derive(Debug)]
struct SimLock {
    disk: SimDisk,
    dir: PathBuf,
}

impl DirLock for SimLock {}

impl Drop for SimLock {
    fn drop(&mut self) {
        self.disk.lock().locks.remove(&self.dir);
    }
}

#[derive(Clone)]
struct SimFile {
    disk: SimDisk,
    id: u64,
    path: PathBuf,
}

impl fmt::Debug for SimFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimFile({})", self.path.display())
    }
}

impl DiskFile for SimFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let mut state = self.disk.lock();
        *state.reads.entry(self.path.clone()).or_default() += 1;
        state.fault(FaultOp::Read, &self.path)?;
        let file = state
            .files
            .get(&self.id)
            .ok_or_else(|| not_found(&self.path))?;
        let start = (offset as usize).min(file.current.len());
        let end = (start + buf.len()).min(file.current.len());
        buf[..end - start].copy_from_slice(&file.current[start..end]);
        Ok(end - start)
    }

    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let delay = self
            .disk
            .lock()
            .slow
            .as_ref()
            .filter(|(path, _)| self.path.to_string_lossy().contains(path.as_str()))
            .map(|(_, delay)| *delay);
        if let Some(delay) = delay {
            std::thread::sleep(delay);
        }
        let mut state = self.disk.lock();
        state.fault(FaultOp::Write, &self.path)?;
        if let Some(capacity) = state.capacity_bytes {
            let current_len = state
                .files
                .get(&self.id)
                .map(|file| file.current.len() as u64)
                .unwrap_or(0);
            let growth = (offset + buf.len() as u64).saturating_sub(current_len);
            if state.used_bytes() + growth > capacity {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
        }
        let file = state
            .files
            .get_mut(&self.id)
            .ok_or_else(|| not_found(&self.path))?;
        let end = offset as usize + buf.len();
        if file.current.len() < end {
            file.current.resize(end, 0);
        }
        file.current[offset as usize..end].copy_from_slice(buf);
        file.pending.push(Pending::Write {
            offset,
            data: buf.to_vec(),
        });
        Ok(())
    }

    /// The same queued, unsynced write as [`DiskFile::write_all_at`] (a direct write reaches the
    /// device's volatile cache at best), after the checks the kernel makes.
    fn write_direct_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if !crate::disk::direct_aligned(buf, offset) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a direct write of {} bytes at {offset} is not aligned",
                    buf.len()
                ),
            ));
        }
        {
            let mut state = self.disk.lock();
            if state.refuse_direct {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "the simulated filesystem refuses O_DIRECT",
                ));
            }
            state.direct_bytes += buf.len() as u64;
        }
        self.write_all_at(buf, offset)
    }

    fn sync_data(&self) -> io::Result<()> {
        let mut state = self.disk.lock();
        if let Err(error) = state.fault(FaultOp::Sync, &self.path) {
            // Linux after a writeback error: the queued writes never reach the disk, the
            // pages stay readable, and the next sync of this file reports success.
            if let Some(file) = state.files.get_mut(&self.id) {
                file.pending.clear();
            }
            return Err(error);
        }
        let file = state
            .files
            .get_mut(&self.id)
            .ok_or_else(|| not_found(&self.path))?;
        for pending in std::mem::take(&mut file.pending) {
            match pending {
                Pending::SetLen(len) => file.durable.resize(len as usize, 0),
                Pending::Write { offset, data } => {
                    let end = offset as usize + data.len();
                    if file.durable.len() < end {
                        file.durable.resize(end, 0);
                    }
                    file.durable[offset as usize..end].copy_from_slice(&data);
                }
            }
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut state = self.disk.lock();
        let file = state
            .files
            .get_mut(&self.id)
            .ok_or_else(|| not_found(&self.path))?;
        file.current.resize(len as usize, 0);
        file.pending.push(Pending::SetLen(len));
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        let state = self.disk.lock();
        let file = state
            .files
            .get(&self.id)
            .ok_or_else(|| not_found(&self.path))?;
        Ok(file.current.len() as u64)
    }

    fn drop_cache(&self) -> io::Result<()> {
        let mut state = self.disk.lock();
        let file = state
            .files
            .get_mut(&self.id)
            .ok_or_else(|| not_found(&self.path))?;
        // What a re-read from the device shows: the durable bytes with the writes still queued
        // for writeback (dirty pages are not dropped); writes whose writeback failed are gone.
        let mut bytes = file.durable.clone();
        for pending in &file.pending {
            match pending {
                Pending::SetLen(len) => bytes.resize(*len as usize, 0),
                Pending::Write { offset, data } => {
                    let end = *offset as usize + data.len();
                    if bytes.len() < end {
                        bytes.resize(end, 0);
                    }
                    bytes[*offset as usize..end].copy_from_slice(data);
                }
            }
        }
        file.current = bytes;
        Ok(())
    }
}

impl Disk for SimDisk {
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let mut state = self.lock();
        let mut ancestors: Vec<&Path> = path.ancestors().collect();
        ancestors.reverse();
        for dir in ancestors {
            state.dirs.entry(dir.to_path_buf()).or_default();
        }
        Ok(())
    }

    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn DiskFile>> {
        let (dir, name) = split(path)?;
        let mut state = self.lock();
        if !state.dirs.contains_key(&dir) {
            return Err(not_found(&dir));
        }
        let existing = state.entry(path);
        let id = match (existing, mode) {
            (Some(_), OpenMode::CreateNew) => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{} exists", path.display()),
                ))
            }
            (Some(id), OpenMode::Truncate) => {
                if let Some(file) = state.files.get_mut(&id) {
                    file.current.clear();
                    file.pending.push(Pending::SetLen(0));
                }
                id
            }
            (Some(id), _) => id,
            (None, OpenMode::Existing) => return Err(not_found(path)),
            (None, _) => {
                state.fault(FaultOp::Create, path)?;
                state.created.push(path.to_path_buf());
                let id = state.next_file;
                state.next_file += 1;
                state.files.insert(id, FileState::default());
                if let Some(entries) = state.dirs.get_mut(&dir) {
                    entries.current.insert(name, id);
                }
                id
            }
        };
        Ok(Arc::new(SimFile {
            disk: self.clone(),
            id,
            path: path.to_path_buf(),
        }))
    }

    fn file_len(&self, path: &Path) -> io::Result<Option<u64>> {
        let state = self.lock();
        Ok(state
            .entry(path)
            .and_then(|id| state.files.get(&id))
            .map(|file| file.current.len() as u64))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let (from_dir, from_name) = split(from)?;
        let (to_dir, to_name) = split(to)?;
        let mut state = self.lock();
        state.fault(FaultOp::Rename, to)?;
        let id = state
            .dirs
            .get_mut(&from_dir)
            .and_then(|entries| entries.current.remove(&from_name))
            .ok_or_else(|| not_found(from))?;
        state
            .dirs
            .get_mut(&to_dir)
            .ok_or_else(|| not_found(&to_dir))?
            .current
            .insert(to_name, id);
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let (dir, name) = split(path)?;
        let mut state = self.lock();
        state
            .dirs
            .get_mut(&dir)
            .and_then(|entries| entries.current.remove(&name))
            .map(|_| ())
            .ok_or_else(|| not_found(path))
    }

    fn list_dir(&self, dir: &Path) -> io::Result<Vec<String>> {
        let state = self.lock();
        state
            .dirs
            .get(dir)
            .map(|entries| entries.current.keys().cloned().collect())
            .ok_or_else(|| not_found(dir))
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.lock();
        state.fault(FaultOp::SyncDir, dir)?;
        let entries = state.dirs.get_mut(dir).ok_or_else(|| not_found(dir))?;
        entries.durable = entries.current.clone();
        Ok(())
    }

    fn lock_dir(&self, dir: &Path) -> io::Result<Option<Box<dyn DirLock>>> {
        let mut state = self.lock();
        if !state.locks.insert(dir.to_path_buf()) {
            return Ok(None);
        }
        Ok(Some(Box::new(SimLock {
            disk: self.clone(),
            dir: dir.to_path_buf(),
        })))
    }

    fn available_bytes(&self, _dir: &Path) -> io::Result<u64> {
        let state = self.lock();
        Ok(match state.capacity_bytes {
            Some(capacity) => capacity.saturating_sub(state.used_bytes()),
            None => u64::MAX / 4,
        })
    }

    fn memory_backed(&self, _dir: &Path) -> io::Result<Option<String>> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves the model: unsynced writes may vanish at a power cut, synced ones stay; a failed
    // sync loses its writes for good while reads still see them, and the next sync "succeeds";
    // directory entries need sync_dir.
    #[test]
    fn durable_volatile_and_the_fsync_trap() -> io::Result<()> {
        let disk = SimDisk::new(1);
        let dir = Path::new("/d");
        disk.create_dir_all(dir)?;
        let file = disk.open(&dir.join("f"), OpenMode::CreateNew)?;
        file.write_all_at(b"durable", 0)?;
        file.sync_data()?;
        disk.sync_dir(dir)?;
        file.write_all_at(b"VOLATILE", 7)?;
        let mut seen_lost = false;
        for _ in 0..16 {
            let after = disk.power_cut();
            let reopened = after.open(&dir.join("f"), OpenMode::Existing)?;
            let mut buf = vec![0u8; 15];
            let read = reopened.read_at(&mut buf, 0)?;
            assert_eq!(&buf[..7], b"durable");
            seen_lost |= read == 7;
        }
        assert!(seen_lost, "an unsynced write sometimes vanishes");

        disk.inject(FaultOp::Sync, "f", libc::EIO, 0, 1);
        assert!(file.sync_data().is_err());
        let mut buf = vec![0u8; 15];
        file.read_at(&mut buf, 0)?;
        assert_eq!(&buf, b"durableVOLATILE", "the page cache still shows it");
        file.sync_data()?; // the trap: success
        let after = disk.power_cut();
        let reopened = after.open(&dir.join("f"), OpenMode::Existing)?;
        assert_eq!(
            reopened.len()?,
            7,
            "the failed writes never reached the disk"
        );
        file.drop_cache()?;
        assert_eq!(
            file.len()?,
            7,
            "a re-read from the device does not see them either"
        );

        let unsynced = disk.open(&dir.join("g"), OpenMode::CreateNew)?;
        unsynced.write_all_at(b"x", 0)?;
        unsynced.sync_data()?;
        let mut survived = 0;
        for _ in 0..16 {
            if disk.power_cut().file_len(&dir.join("g"))?.is_some() {
                survived += 1;
            }
        }
        assert!(survived < 16, "an entry without sync_dir is sometimes lost");
        Ok(())
    }
}
