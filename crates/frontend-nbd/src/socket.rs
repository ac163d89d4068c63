//! The byte stream a session runs on: a blocking socket that several threads of one connection
//! use at once (one reading requests, others writing replies), and that the server can shut down
//! from outside to wake a thread blocked on it.

use std::io;
use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

/// A connected, blocking stream socket shared by the threads of one session. Implemented for
/// [`TcpStream`] and [`UnixStream`] (whose `&` references read and write).
pub trait Socket: Send + Sync + 'static {
    fn read(&self, buf: &mut [u8]) -> io::Result<usize>;
    fn write(&self, buf: &[u8]) -> io::Result<usize>;
    fn write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize>;
    /// `Shutdown::Read` wakes a thread blocked in `read` (it sees end of stream);
    /// `Shutdown::Both` also fails a blocked `write`.
    fn shutdown(&self, how: Shutdown) -> io::Result<()>;
    /// Bounds each `read` (`None`: no bound). A read that times out fails with
    /// `WouldBlock` or `TimedOut`.
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// Bounds each `write` the same way.
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
}

macro_rules! impl_socket {
    ($type:ty) => {
        impl Socket for $type {
            fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
                <&$type as Read>::read(&mut &*self, buf)
            }
            fn write(&self, buf: &[u8]) -> io::Result<usize> {
                <&$type as Write>::write(&mut &*self, buf)
            }
            fn write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
                <&$type as Write>::write_vectored(&mut &*self, bufs)
            }
            fn shutdown(&self, how: Shutdown) -> io::Result<()> {
                <$type>::shutdown(self, how)
            }
            fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
                <$type>::set_read_timeout(self, timeout)
            }
            fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
                <$type>::set_write_timeout(self, timeout)
            }
        }
    };
}

impl_socket!(TcpStream);
impl_socket!(UnixStream);

/// `Read` over a shared socket (for a `BufReader`), noting when bytes last arrived.
pub(crate) struct SocketReader {
    pub socket: Arc<dyn Socket>,
    pub activity: Option<Arc<crate::server::Activity>>,
}

impl Read for SocketReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let read = self.socket.read(buf)?;
        if read > 0 {
            if let Some(activity) = &self.activity {
                activity.touch();
            }
        }
        Ok(read)
    }
}

/// Writes all of `buffers`, in order, with as few system calls as the socket allows.
pub(crate) fn write_all_vectored(socket: &dyn Socket, buffers: &[Vec<u8>]) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = buffers
        .iter()
        .filter(|buffer| !buffer.is_empty())
        .map(|buffer| IoSlice::new(buffer))
        .collect();
    let mut remaining = &mut slices[..];
    while !remaining.is_empty() {
        // writev takes at most IOV_MAX (1024) slices; the socket takes what it can.
        let chunk = remaining.len().min(1024);
        match socket.write_vectored(&remaining[..chunk]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(written) => IoSlice::advance_slices(&mut remaining, written),
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// Whether an I/O error is a socket timeout firing.
pub(crate) fn is_timeout(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}
