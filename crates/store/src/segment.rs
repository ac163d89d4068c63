//! Devices (data directories) and the segment files on them. With two devices every segment
//! exists on both with identical bytes at identical offsets (a mirror of the log), so one index
//! location names both copies and a bad copy is repaired by rewriting the good bytes in place.
//!
//! Invariants: a segment file is created with its header synced and its directory fsynced before
//! any extent is appended to it; a segment is unlinked only after a durable index checkpoint no
//! longer needs it; each data directory is locked (flock) by exactly one process.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use crate::disk::{DirLock, Disk, DiskFile, OpenMode, DIRECT_ALIGN};
use crate::error::{StoreError, StoreResult};
use crate::format;

const STORE_ID_FILE: &str = "store-id";
const SEGMENTS_DIR: &str = "segments";

pub(crate) struct Device {
    pub dir: PathBuf,
    pub segments_dir: PathBuf,
    /// Held for the store's life; released when dropped.
    _lock: Box<dyn DirLock>,
}

pub(crate) struct Segment {
    pub id: u64,
    /// One file per device, same order as `Segments::devices`.
    pub files: Vec<Arc<dyn DiskFile>>,
    pub paths: Vec<PathBuf>,
}

/// One block of a [`BatchBuffer`]: its alignment is what makes the buffer's address a multiple
/// of [`DIRECT_ALIGN`].
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct AlignedBlock([u8; DIRECT_ALIGN]);

/// The buffer a group commit lays its batch into, kept for the next (it grows to the largest
/// batch, at most `batch_size_max_bytes` and a block). Each byte sits at the address its file
/// offset has modulo [`DIRECT_ALIGN`], so the batch's whole blocks can go to the device
/// around the page cache straight from it ([`Segment::append`]), without a copy.
#[derive(Default)]
pub(crate) struct BatchBuffer {
    blocks: Vec<AlignedBlock>,
}

impl BatchBuffer {
    /// `len` bytes to be appended at file offset `offset`, to be overwritten whole: what an
    /// earlier batch left in them is not cleared.
    pub fn for_append(&mut self, offset: u64, len: usize) -> &mut [u8] {
        let lead = (offset % DIRECT_ALIGN as u64) as usize;
        let count = (lead + len).div_ceil(DIRECT_ALIGN);
        if self.blocks.len() < count {
            self.blocks.resize(count, AlignedBlock([0; DIRECT_ALIGN]));
        }
        let whole: &mut [AlignedBlock] = &mut self.blocks[..count];
        // SAFETY: `AlignedBlock` is a `repr(C)` array of bytes with no padding between elements
        // (its size is its alignment), so `count` blocks are that many times `DIRECT_ALIGN`
        // initialised bytes, borrowed mutably for as long as `whole` is.
        let all: &mut [u8] = unsafe {
            std::slice::from_raw_parts_mut(whole.as_mut_ptr().cast::<u8>(), count * DIRECT_ALIGN)
        };
        &mut all[lead..lead + len]
    }

    /// The bytes it holds.
    pub fn capacity_bytes(&self) -> usize {
        self.blocks.len() * DIRECT_ALIGN
    }
}

/// Appends around the page cache: whether the filesystem refused direct I/O (then every
/// append goes through the cache).
pub(crate) struct DirectWrites {
    refused: AtomicBool,
}

impl DirectWrites {
    /// Bytes one direct write carries at most: large enough that the kernel splits it into
    /// requests the device serves in parallel.
    pub const CHUNK_BYTES: usize = 4 << 20;

    pub fn new() -> DirectWrites {
        DirectWrites {
            refused: AtomicBool::new(false),
        }
    }

    pub fn refused(&self) -> bool {
        self.refused.load(Ordering::Relaxed)
    }
}

impl Segment {
    /// Appends `bytes` at `offset` on every device. With `direct`, the whole blocks inside the
    /// range go to the devices around the page cache (`O_DIRECT`), the partial blocks at either
    /// end through it: no byte already written is written again, and the file grows exactly
    /// as with one ordinary write. Their address must be aligned as their offset is (a
    /// [`BatchBuffer`]'s are); bytes that are not, and a filesystem that refuses direct I/O,
    /// get ordinary writes (and `direct` remembers the refusal).
    pub fn append(
        &self,
        bytes: &[u8],
        offset: u64,
        direct: Option<&DirectWrites>,
    ) -> StoreResult<()> {
        let align = DIRECT_ALIGN as u64;
        let end = offset + bytes.len() as u64;
        let first = offset.next_multiple_of(align);
        let last = end / align * align;
        let head = first.saturating_sub(offset) as usize;
        let direct = match direct {
            Some(direct)
                if !direct.refused()
                    && first < last
                    && (bytes[head..].as_ptr() as usize).is_multiple_of(DIRECT_ALIGN) =>
            {
                direct
            }
            _ => return self.write_all_at(bytes, offset),
        };
        let tail = (last - offset) as usize;
        if head > 0 {
            self.write_all_at(&bytes[..head], offset)?;
        }
        let mut at = first;
        for chunk in bytes[head..tail].chunks(DirectWrites::CHUNK_BYTES) {
            let refused = &direct.refused;
            self.on_every_device(|_, file, path| {
                if refused.load(Ordering::Relaxed) {
                    return file
                        .write_all_at(chunk, at)
                        .map_err(|e| StoreError::io(path, e));
                }
                let written = match file.write_direct_at(chunk, at) {
                    Err(error) if error.kind() == std::io::ErrorKind::Unsupported => {
                        if !refused.swap(true, Ordering::Relaxed) {
                            tracing::warn!(%error, "large appends go through the page cache");
                        }
                        file.write_all_at(chunk, at)
                    }
                    other => other,
                };
                written.map_err(|e| StoreError::io(path, e))
            })?;
            at += chunk.len() as u64;
        }
        if tail < bytes.len() {
            self.write_all_at(&bytes[tail..], last)?;
        }
        Ok(())
    }

    /// Writes `bytes` at `offset` on every device (in parallel when mirrored).
    pub fn write_all_at(&self, bytes: &[u8], offset: u64) -> StoreResult<()> {
        self.on_every_device(|_, file, path| {
            file.write_all_at(bytes, offset)
                .map_err(|e| StoreError::io(path, e))
        })
    }

    /// fdatasync on every device (in parallel when mirrored).
    pub fn sync(&self) -> StoreResult<()> {
        self.on_every_device(|_, file, path| file.sync_data().map_err(|e| StoreError::io(path, e)))
    }

    /// [`Segment::sync`], timing each device's fdatasync into its entry of `per_device`.
    pub(crate) fn sync_timed(&self, per_device: &[crate::latency::SyncTimes]) -> StoreResult<()> {
        self.on_every_device(|device, file, path| {
            let started = std::time::Instant::now();
            let synced = file.sync_data().map_err(|e| StoreError::io(path, e));
            if let Some(times) = per_device.get(device) {
                times.observe(started.elapsed());
            }
            synced
        })
    }

    /// Cuts every copy back to `len` bytes (used to drop the bytes of a failed append).
    pub fn truncate(&self, len: u64) -> StoreResult<()> {
        self.on_every_device(|_, file, path| file.set_len(len).map_err(|e| StoreError::io(path, e)))
    }

    pub fn read_at(&self, device: usize, offset: u64, len: usize) -> StoreResult<Vec<u8>> {
        let mut buf = vec![0u8; len];
        let read = self.read_into(device, offset, &mut buf)?;
        buf.truncate(read);
        Ok(buf)
    }

    /// Reads up to `buf.len()` bytes at `offset` into `buf`; fewer only at the file's end.
    pub fn read_into(&self, device: usize, offset: u64, buf: &mut [u8]) -> StoreResult<usize> {
        crate::disk::read_up_to(self.files[device].as_ref(), buf, offset)
            .map_err(|e| StoreError::io(&self.paths[device], e))
    }

    /// Drops every copy's cached pages, so replay reads what the devices hold.
    pub fn drop_cache(&self) -> StoreResult<()> {
        self.on_every_device(|_, file, path| file.drop_cache().map_err(|e| StoreError::io(path, e)))
    }

    /// Rewrites one device's copy of a range with verified bytes and syncs it.
    pub fn repair_at(&self, device: usize, bytes: &[u8], offset: u64) -> StoreResult<()> {
        let file = &self.files[device];
        let path = &self.paths[device];
        file.write_all_at(bytes, offset)
            .and_then(|_| file.sync_data())
            .map_err(|e| StoreError::io(path, e))
    }

    pub fn len(&self, device: usize) -> StoreResult<u64> {
        self.files[device]
            .len()
            .map_err(|e| StoreError::io(&self.paths[device], e))
    }

    /// Runs `op(device index, file, path)` for every device's copy.
    fn on_every_device(
        &self,
        op: impl Fn(usize, &dyn DiskFile, &Path) -> StoreResult<()> + Sync,
    ) -> StoreResult<()> {
        if self.files.len() == 1 {
            return op(0, self.files[0].as_ref(), &self.paths[0]);
        }
        std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .files
                .iter()
                .zip(&self.paths)
                .enumerate()
                .skip(1)
                .map(|(device, (file, path))| {
                    let op = &op;
                    scope.spawn(move || op(device, file.as_ref(), path))
                })
                .collect();
            let first = op(0, self.files[0].as_ref(), &self.paths[0]);
            let mut result = first;
            for handle in handles {
                let other = handle.join().unwrap_or_else(|_| {
                    Err(StoreError::Invalid("mirror I/O thread panicked".into()))
                });
                if result.is_ok() {
                    result = other;
                }
            }
            result
        })
    }
}

pub(crate) struct Segments {
    pub disk: Arc<dyn Disk>,
    pub devices: Vec<Device>,
    pub store_id: [u8; 16],
    map: RwLock<BTreeMap<u64, Arc<Segment>>>,
}

fn segment_file_name(id: u64) -> String {
    format!("{id:016x}.seg")
}

const PREPARED_SUFFIX: &str = ".seg.prepared";

fn prepared_file_name(id: u64) -> String {
    format!("{id:016x}{PREPARED_SUFFIX}")
}

/// Zero bytes written per call when filling a prepared segment.
const ZERO_FILL_CHUNK_BYTES: usize = 1 << 20;

/// A segment file made ahead of need: header, then zeros to its full size, synced. Appending into
/// it overwrites allocated blocks without growing the file, so each `fdatasync` flushes data only
/// instead of also committing the filesystem's journal for a new size and new blocks (measured on
/// ext4: ~120 us instead of ~200 us per 4 KiB sync). Zeros read as "no extent", so recovery
/// stops at the first unwritten byte as it does at the end of a file.
pub(crate) struct Preparation {
    disk: Arc<dyn Disk>,
    /// Set when the writer reached this segment first: the preparation stops (within one
    /// chunk of zeros) and removes its files.
    cancel: Arc<AtomicBool>,
    id: u64,
    size_bytes: u64,
    store_id: [u8; 16],
    paths: Vec<PathBuf>,
    /// Free space that must remain on every device after the file is filled.
    reserve_bytes: u64,
}

impl Preparation {
    /// Writes the files: `Ok(true)` once they are ready, `Ok(false)` when cancelled. On failure
    /// (a full disk, say) or cancellation they are removed and the caller falls back to a
    /// plain, growing segment. Nothing is written when filling the files would eat into the
    /// reserve: the zeros are an optimisation, never worth the space deletes need.
    pub fn run(self) -> StoreResult<bool> {
        for path in &self.paths {
            let dir = path.parent().unwrap_or(path);
            let available = self
                .disk
                .available_bytes(dir)
                .map_err(|e| StoreError::io(dir, e))?;
            if available < self.size_bytes.saturating_add(self.reserve_bytes) {
                return Err(StoreError::NoSpace {
                    path: dir.to_path_buf(),
                    available_bytes: available,
                    reserve_bytes: self.reserve_bytes,
                });
            }
        }
        let result = self.write_all();
        if !matches!(result, Ok(true)) {
            for path in &self.paths {
                let _ = self.disk.remove_file(path);
            }
        }
        result
    }

    fn write_all(&self) -> StoreResult<bool> {
        let header = format::encode_segment_header(self.id, &self.store_id);
        let zeros = vec![0u8; ZERO_FILL_CHUNK_BYTES];
        for path in &self.paths {
            let file = self
                .disk
                .open(path, OpenMode::Truncate)
                .map_err(|e| StoreError::io(path, e))?;
            file.write_all_at(&header, 0)
                .map_err(|e| StoreError::io(path, e))?;
            let mut offset = format::SEGMENT_HEADER_LEN as u64;
            while offset < self.size_bytes {
                if self.cancel.load(Ordering::SeqCst) {
                    return Ok(false);
                }
                let len = (self.size_bytes - offset).min(zeros.len() as u64) as usize;
                file.write_all_at(&zeros[..len], offset)
                    .map_err(|e| StoreError::io(path, e))?;
                offset += len as u64;
            }
            file.sync_data().map_err(|e| StoreError::io(path, e))?;
        }
        Ok(true)
    }
}

pub(crate) fn sync_dir(disk: &dyn Disk, dir: &Path) -> StoreResult<()> {
    disk.sync_dir(dir).map_err(|e| StoreError::io(dir, e))
}

/// A whole small file, or `None` if it does not exist.
pub(crate) fn read_file(disk: &dyn Disk, path: &Path) -> StoreResult<Option<Vec<u8>>> {
    let Some(len) = disk.file_len(path).map_err(|e| StoreError::io(path, e))? else {
        return Ok(None);
    };
    let file = disk
        .open(path, OpenMode::Existing)
        .map_err(|e| StoreError::io(path, e))?;
    let mut bytes = vec![0u8; len as usize];
    let read = crate::disk::read_up_to(file.as_ref(), &mut bytes, 0)
        .map_err(|e| StoreError::io(path, e))?;
    bytes.truncate(read);
    Ok(Some(bytes))
}

fn read_store_id(disk: &dyn Disk, dir: &Path) -> StoreResult<Option<[u8; 16]>> {
    let path = dir.join(STORE_ID_FILE);
    let Some(bytes) = read_file(disk, &path)? else {
        return Ok(None);
    };
    let text = String::from_utf8_lossy(&bytes);
    let bytes = hex_decode(text.trim())
        .filter(|b| b.len() == 16)
        .ok_or_else(|| StoreError::Mismatch(format!("{} is not a store id", path.display())))?;
    let mut id = [0u8; 16];
    id.copy_from_slice(&bytes);
    Ok(Some(id))
}

fn hex_decode(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes a small file atomically and durably: temp file, sync, rename, directory sync.
pub(crate) fn write_file_durably(
    disk: &dyn Disk,
    dir: &Path,
    name: &str,
    contents: &[u8],
) -> StoreResult<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    let path = dir.join(name);
    let file = disk
        .open(&tmp, OpenMode::Truncate)
        .map_err(|e| StoreError::io(&tmp, e))?;
    file.write_all_at(contents, 0)
        .and_then(|_| file.sync_data())
        .map_err(|e| StoreError::io(&tmp, e))?;
    disk.rename(&tmp, &path)
        .map_err(|e| StoreError::io(&path, e))?;
    sync_dir(disk, dir)
}

fn new_store_id() -> [u8; 16] {
    let mut hasher = blake3::Hasher::new();
    hasher.update(&std::process::id().to_le_bytes());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    hasher.update(&now.to_le_bytes());
    let mut id = [0u8; 16];
    id.copy_from_slice(&hasher.finalize().as_bytes()[..16]);
    id
}

impl Segments {
    pub fn open(disk: Arc<dyn Disk>, dirs: &[PathBuf], ephemeral: bool) -> StoreResult<Segments> {
        if dirs.is_empty() || dirs.len() > 2 {
            return Err(StoreError::Invalid(format!(
                "a store needs one data directory, or two for a mirror; got {}",
                dirs.len()
            )));
        }
        let mut devices = Vec::new();
        let mut ids = Vec::new();
        for dir in dirs {
            disk.create_dir_all(dir)
                .map_err(|e| StoreError::io(dir, e))?;
            let memory = disk
                .memory_backed(dir)
                .map_err(|e| StoreError::io(dir, e))?;
            if let (Some(filesystem), false) = (memory, ephemeral) {
                return Err(StoreError::VolatileFilesystem {
                    path: dir.clone(),
                    filesystem,
                });
            }
            let lock = disk
                .lock_dir(dir)
                .map_err(|e| StoreError::io(dir, e))?
                .ok_or_else(|| StoreError::Locked { path: dir.clone() })?;
            let segments_dir = dir.join(SEGMENTS_DIR);
            if disk.list_dir(&segments_dir).is_err() {
                disk.create_dir_all(&segments_dir)
                    .map_err(|e| StoreError::io(&segments_dir, e))?;
                sync_dir(disk.as_ref(), dir)?;
            }
            ids.push(read_store_id(disk.as_ref(), dir)?);
            devices.push(Device {
                dir: dir.clone(),
                segments_dir,
                _lock: lock,
            });
        }
        let store_id = match (ids.iter().flatten().next(), ids.iter().all(Option::is_none)) {
            (_, true) => {
                let id = new_store_id();
                for device in &devices {
                    write_file_durably(
                        disk.as_ref(),
                        &device.dir,
                        STORE_ID_FILE,
                        hex(&id).as_bytes(),
                    )?;
                }
                id
            }
            (Some(first), false) => {
                for (device, id) in devices.iter().zip(&ids) {
                    match id {
                        Some(id) if id == first => {}
                        Some(_) => {
                            return Err(StoreError::Mismatch(format!(
                                "{} belongs to another store",
                                device.dir.display()
                            )))
                        }
                        None => {
                            return Err(StoreError::Mismatch(format!(
                                "{} is empty while its mirror holds data; resilvering a \
                                 replaced device is not supported yet",
                                device.dir.display()
                            )))
                        }
                    }
                }
                *first
            }
            (None, false) => unreachable!("some id is present when not all are None"),
        };
        let segments = Segments {
            disk,
            devices,
            store_id,
            map: RwLock::new(BTreeMap::new()),
        };
        segments.load_existing()?;
        Ok(segments)
    }

    /// Opens every segment file found on the first device, checking its mirror copy exists.
    fn load_existing(&self) -> StoreResult<()> {
        let first = &self.devices[0].segments_dir;
        let mut ids = Vec::new();
        for name in self
            .disk
            .list_dir(first)
            .map_err(|e| StoreError::io(first, e))?
        {
            if let Some(stem) = name.strip_suffix(".seg") {
                if let Ok(id) = u64::from_str_radix(stem, 16) {
                    ids.push(id);
                }
            }
        }
        ids.sort_unstable();
        let mut map = self.map.write().map_err(|_| poisoned_lock())?;
        for id in ids {
            let mut files = Vec::new();
            let mut paths = Vec::new();
            for device in &self.devices {
                let path = device.segments_dir.join(segment_file_name(id));
                let file = self
                    .disk
                    .open(&path, OpenMode::Existing)
                    .map_err(|e| StoreError::io(&path, e))?;
                files.push(file);
                paths.push(path);
            }
            let segment = Segment { id, files, paths };
            let header = segment.read_at(0, 0, format::SEGMENT_HEADER_LEN)?;
            let (header_id, store_id) = format::decode_segment_header(&header)?;
            if header_id != id || store_id != self.store_id {
                return Err(StoreError::Mismatch(format!(
                    "{} does not belong to this store",
                    segment.paths[0].display()
                )));
            }
            map.insert(id, Arc::new(segment));
        }
        Ok(())
    }

    pub fn create(&self, id: u64) -> StoreResult<Arc<Segment>> {
        let header = format::encode_segment_header(id, &self.store_id);
        let mut files = Vec::new();
        let mut paths: Vec<PathBuf> = Vec::new();
        for device in &self.devices {
            let path = device.segments_dir.join(segment_file_name(id));
            let file = match self.disk.open(&path, OpenMode::CreateNew) {
                Ok(file) => file,
                Err(error) => {
                    // Not created on every device: undo the ones that were, so no half pair
                    // blocks later rolls (or the next open).
                    for created in &paths {
                        let _ = self.disk.remove_file(created);
                    }
                    return Err(StoreError::io(&path, error));
                }
            };
            files.push(file);
            paths.push(path);
        }
        let segment = Arc::new(Segment { id, files, paths });
        let written = segment
            .write_all_at(&header, 0)
            .and_then(|_| segment.sync())
            .and_then(|_| self.sync_segment_dirs());
        if let Err(error) = written {
            for path in &segment.paths {
                let _ = self.disk.remove_file(path);
            }
            let _ = self.sync_segment_dirs();
            return Err(error);
        }
        self.map
            .write()
            .map_err(|_| poisoned_lock())?
            .insert(id, segment.clone());
        Ok(segment)
    }

    /// What a background preparation of segment `id` needs, owned, so it can run on its own
    /// thread.
    pub fn preparation(
        &self,
        id: u64,
        size_bytes: u64,
        reserve_bytes: u64,
        cancel: Arc<AtomicBool>,
    ) -> Preparation {
        Preparation {
            disk: self.disk.clone(),
            cancel,
            id,
            size_bytes,
            reserve_bytes,
            store_id: self.store_id,
            paths: self
                .devices
                .iter()
                .map(|d| d.segments_dir.join(prepared_file_name(id)))
                .collect(),
        }
    }

    /// Whether a finished preparation of segment `id` left full-size files on every device.
    pub fn preparation_complete(&self, id: u64, size_bytes: u64) -> bool {
        self.devices.iter().all(|device| {
            self.disk
                .file_len(&device.segments_dir.join(prepared_file_name(id)))
                .is_ok_and(|len| len == Some(size_bytes))
        })
    }

    /// Makes a prepared (zero-filled, synced) segment `id` part of the log: renames it into place
    /// on every device and syncs the directories. `Ok(None)` when no complete preparation exists.
    pub fn activate_prepared(&self, id: u64, size_bytes: u64) -> StoreResult<Option<Arc<Segment>>> {
        let mut files = Vec::new();
        let mut paths = Vec::new();
        for device in &self.devices {
            let prepared = device.segments_dir.join(prepared_file_name(id));
            match self.disk.file_len(&prepared) {
                Ok(Some(len)) if len == size_bytes => {}
                _ => return Ok(None),
            }
            let path = device.segments_dir.join(segment_file_name(id));
            if matches!(self.disk.file_len(&path), Ok(Some(_))) {
                return Err(StoreError::Invalid(format!(
                    "{} exists before its prepared file was activated",
                    path.display()
                )));
            }
            self.disk
                .rename(&prepared, &path)
                .map_err(|e| StoreError::io(&path, e))?;
            let file = self
                .disk
                .open(&path, OpenMode::Existing)
                .map_err(|e| StoreError::io(&path, e))?;
            files.push(file);
            paths.push(path);
        }
        self.sync_segment_dirs()?;
        let segment = Arc::new(Segment { id, files, paths });
        self.map
            .write()
            .map_err(|_| poisoned_lock())?
            .insert(id, segment.clone());
        Ok(Some(segment))
    }

    /// Deletes preparation files (a crash may leave them half written).
    pub fn remove_preparations(&self) -> StoreResult<()> {
        for device in &self.devices {
            let dir = &device.segments_dir;
            for name in self
                .disk
                .list_dir(dir)
                .map_err(|e| StoreError::io(dir, e))?
            {
                if name.ends_with(PREPARED_SUFFIX) {
                    let path = dir.join(&name);
                    self.disk
                        .remove_file(&path)
                        .map_err(|e| StoreError::io(&path, e))?;
                }
            }
        }
        Ok(())
    }

    pub fn sync_segment_dirs(&self) -> StoreResult<()> {
        for device in &self.devices {
            sync_dir(self.disk.as_ref(), &device.segments_dir)?;
        }
        Ok(())
    }

    pub fn get(&self, id: u64) -> Option<Arc<Segment>> {
        self.map.read().ok()?.get(&id).cloned()
    }

    pub fn ids(&self) -> Vec<u64> {
        self.map
            .read()
            .map(|m| m.keys().copied().collect())
            .unwrap_or_default()
    }

    /// Unlinks a segment on every device and syncs the directories.
    pub fn remove(&self, id: u64) -> StoreResult<()> {
        let segment = self.map.write().map_err(|_| poisoned_lock())?.remove(&id);
        if let Some(segment) = segment {
            for path in &segment.paths {
                self.disk
                    .remove_file(path)
                    .map_err(|e| StoreError::io(path, e))?;
            }
            self.sync_segment_dirs()?;
        }
        Ok(())
    }
}

fn poisoned_lock() -> StoreError {
    StoreError::Invalid("segment map lock poisoned by a panic".into())
}
