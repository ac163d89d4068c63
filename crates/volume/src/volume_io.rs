//! The seam between a volume's users (NBD exports, the CSI node, tests) and whoever performs
//! its I/O: this node's engine ([`crate::VolumeHandle`]) or, for a replicated volume, the
//! replication layer (which writes locally and streams to the replicas).
//!
//! The contract every implementation keeps (an honest disk with a volatile write cache):
//! `write` returns once the write is ordered (later reads see it); `flush` returns once every
//! write that returned before it is durable where the volume's durability says; a write with
//! `fua` is durable, with everything before it, when it returns.

use bytes::Bytes;

use crate::VolumeResult;

pub trait VolumeIo: Send + Sync {
    fn name(&self) -> &str;
    fn size_bytes(&self) -> u64;
    fn block_size_bytes(&self) -> u32;
    /// Snapshot exports are read-only.
    fn read_only(&self) -> bool;
    /// Reads `buf.len()` bytes at `offset`; never-written blocks read as zeroes.
    fn read(&self, offset: u64, buf: &mut [u8]) -> VolumeResult<()>;
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> VolumeResult<()>;
    /// [`VolumeIo::write`] of bytes the caller shares: an implementation may keep them
    /// without a copy.
    fn write_shared(&self, offset: u64, data: &Bytes, fua: bool) -> VolumeResult<()> {
        self.write(offset, data, fua)
    }
    fn flush(&self) -> VolumeResult<()>;
    /// Discards whole blocks in the range (a hint: partial blocks stay).
    fn trim(&self, offset: u64, length: u64) -> VolumeResult<()>;
    fn write_zeroes(&self, offset: u64, length: u64, fua: bool, may_trim: bool)
        -> VolumeResult<()>;
    /// Whether the range was never written (it reads as zeroes), when that is cheap to know;
    /// false means "maybe written".
    fn range_unwritten(&self, _offset: u64, _length: u64) -> VolumeResult<bool> {
        Ok(false)
    }
}

impl VolumeIo for crate::VolumeHandle {
    fn name(&self) -> &str {
        crate::VolumeHandle::name(self)
    }

    fn range_unwritten(&self, offset: u64, length: u64) -> VolumeResult<bool> {
        crate::VolumeHandle::range_unwritten(self, offset, length)
    }

    fn size_bytes(&self) -> u64 {
        crate::VolumeHandle::size_bytes(self)
    }

    fn block_size_bytes(&self) -> u32 {
        crate::VolumeHandle::block_size_bytes(self)
    }

    fn read_only(&self) -> bool {
        crate::VolumeHandle::read_only(self)
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> VolumeResult<()> {
        crate::VolumeHandle::read(self, offset, buf)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> VolumeResult<()> {
        crate::VolumeHandle::write(self, offset, data, fua)
    }

    fn write_shared(&self, offset: u64, data: &Bytes, fua: bool) -> VolumeResult<()> {
        crate::VolumeHandle::write_shared(self, offset, data, fua)
    }

    fn flush(&self) -> VolumeResult<()> {
        crate::VolumeHandle::flush(self)
    }

    fn trim(&self, offset: u64, length: u64) -> VolumeResult<()> {
        crate::VolumeHandle::trim(self, offset, length)
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        may_trim: bool,
    ) -> VolumeResult<()> {
        crate::VolumeHandle::write_zeroes(self, offset, length, fua, may_trim)
    }
}

impl<T: VolumeIo + ?Sized> VolumeIo for std::sync::Arc<T> {
    fn name(&self) -> &str {
        (**self).name()
    }

    fn range_unwritten(&self, offset: u64, length: u64) -> VolumeResult<bool> {
        (**self).range_unwritten(offset, length)
    }

    fn size_bytes(&self) -> u64 {
        (**self).size_bytes()
    }

    fn block_size_bytes(&self) -> u32 {
        (**self).block_size_bytes()
    }

    fn read_only(&self) -> bool {
        (**self).read_only()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> VolumeResult<()> {
        (**self).read(offset, buf)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> VolumeResult<()> {
        (**self).write(offset, data, fua)
    }

    fn flush(&self) -> VolumeResult<()> {
        (**self).flush()
    }

    fn trim(&self, offset: u64, length: u64) -> VolumeResult<()> {
        (**self).trim(offset, length)
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
        may_trim: bool,
    ) -> VolumeResult<()> {
        (**self).write_zeroes(offset, length, fua, may_trim)
    }
}
