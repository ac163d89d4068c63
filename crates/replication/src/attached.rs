//! A volume as the clients attached here see it, through whatever serves it now:
//! - with one replica, its local copy, until raising R makes this node its primary
//!   ([`crate::Replication::set_replicas`]): none of the I/O in flight can land after the new
//!   replicas started comparing what they hold;
//! - with more, the primary served here, until this node drains and hands the volume to
//!   another replica, whose primary it then forwards to ([`crate::Replication`]'s hand-off):
//!   no write lands between the hand-off's FLUSH and the new primary;
//! - forwarded so, until the volume is handed back: then the handle of the primary served
//!   here again, once a FLUSH through the forwarding went through
//!   ([`crate::Replication`]'s `bring_clients_back`).
//!
//! Every I/O runs under a read lock, so a switch waits for the I/O in flight.

use std::sync::{Arc, RwLock, RwLockReadGuard};

use keel_volume::{VolumeIo, VolumeResult};

pub(crate) struct Attached {
    name: String,
    inner: RwLock<Arc<dyn VolumeIo>>,
}

impl Attached {
    pub(crate) fn new(name: &str, local: Arc<dyn VolumeIo>) -> Attached {
        Attached {
            name: name.to_string(),
            inner: RwLock::new(local),
        }
    }

    fn current(&self) -> RwLockReadGuard<'_, Arc<dyn VolumeIo>> {
        self.inner
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether clients reach `io` through this now.
    pub(crate) fn serves<T: ?Sized>(&self, io: &Arc<T>) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&*self.current()), Arc::as_ptr(io))
    }

    /// Runs `make` with what serves the clients now, once no I/O is in flight, and serves
    /// every later I/O through what it returns.
    pub(crate) fn switch<E>(
        &self,
        make: impl FnOnce(&Arc<dyn VolumeIo>) -> Result<Arc<dyn VolumeIo>, E>,
    ) -> Result<(), E> {
        let mut inner = self
            .inner
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *inner = make(&inner)?;
        Ok(())
    }
}

impl VolumeIo for Attached {
    fn name(&self) -> &str {
        &self.name
    }

    fn size_bytes(&self) -> u64 {
        self.current().size_bytes()
    }

    fn block_size_bytes(&self) -> u32 {
        self.current().block_size_bytes()
    }

    fn read_only(&self) -> bool {
        self.current().read_only()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> VolumeResult<()> {
        self.current().read(offset, buf)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> VolumeResult<()> {
        self.current().write(offset, data, fua)
    }

    fn flush(&self) -> VolumeResult<()> {
        self.current().flush()
    }

    fn trim(&self, offset: u64, length: u64) -> VolumeResult<()> {
        self.current().trim(offset, length)
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        may_trim: bool,
    ) -> VolumeResult<()> {
        self.current().write_zeroes(offset, length, fua, may_trim)
    }
}
