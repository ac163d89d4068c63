//! Small files the server keeps next to its data: tokens, the scrub schedule.

use std::path::Path;

use anyhow::Context;

/// Writes `bytes` to `path` so that a crash leaves the old file or the new one: a temporary
/// file, synced, renamed over `path`, then the directory synced.
pub fn write_file_atomically(path: &Path, bytes: &[u8], mode: u32) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let temporary = path.with_extension("tmp");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(mode)
        .open(&temporary)
        .with_context(|| format!("creating {}", temporary.display()))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", temporary.display()))?;
    std::fs::rename(&temporary, path)
        .with_context(|| format!("renaming {} into place", temporary.display()))?;
    if let Some(parent) = path.parent() {
        std::fs::File::open(parent)
            .and_then(|dir| dir.sync_all())
            .with_context(|| format!("syncing {}", parent.display()))?;
    }
    Ok(())
}
