//! Snapshots, clones, rollback and snapshot deletion on a real store, checked byte for byte.
#![allow(clippy::unwrap_used)]

mod volume_support;

use keel_namespace::volume::{VolumeError, VolumeSpec};
use volume_support::*;

const SIZE: u64 = 64 * BLOCK;

// Proves a snapshot keeps the bytes it had when taken while the volume is overwritten, trimmed
// and partially rewritten, and that this holds after reopening.
#[test]
fn snapshot_stays_frozen() {
    let dir = test_dir("frozen");
    let first = pattern(1, SIZE as usize);
    let mut second = first.clone();
    {
        let manager = open_manager(&dir);
        manager.create(&VolumeSpec::new("v", SIZE)).unwrap();
        let handle = manager.open_volume("v").unwrap();
        handle.write(0, &first, false).unwrap();
        let info = manager.snapshot_create("v", "s1").unwrap();
        assert_eq!(info.size_bytes, SIZE);
        assert!(matches!(
            manager.snapshot_create("v", "s1"),
            Err(VolumeError::SnapshotExists { .. })
        ));
        handle
            .write(3 * BLOCK + 10, &pattern(2, 5 * BLOCK as usize), false)
            .unwrap();
        second[(3 * BLOCK + 10) as usize..(8 * BLOCK + 10) as usize]
            .copy_from_slice(&pattern(2, 5 * BLOCK as usize));
        handle.trim(20 * BLOCK, 4 * BLOCK).unwrap();
        second[(20 * BLOCK) as usize..(24 * BLOCK) as usize].fill(0);
        assert_same_blocks(&read_all(&handle), &second, "volume");
        let snapshot = manager.open_snapshot("v", "s1").unwrap();
        assert_same_blocks(&read_all(&snapshot), &first, "snapshot");
    }
    let manager = open_manager(&dir);
    let snapshot = manager.open_snapshot("v", "s1").unwrap();
    assert_same_blocks(&read_all(&snapshot), &first, "snapshot after reopen");
    let handle = manager.open_volume("v").unwrap();
    assert_same_blocks(&read_all(&handle), &second, "volume after reopen");
}

// Proves a clone starts with the snapshot's bytes and then diverges independently: writes to
// the clone do not show in the parent or the snapshot, writes to the parent do not show in the
// clone; a clone of a clone works too; dependent snapshots and volumes cannot be deleted.
#[test]
fn clone_is_independent_both_ways() {
    let dir = test_dir("clone");
    let manager = open_manager(&dir);
    manager.create(&VolumeSpec::new("parent", SIZE)).unwrap();
    let parent = manager.open_volume("parent").unwrap();
    let base = pattern(10, SIZE as usize);
    parent.write(0, &base, false).unwrap();
    manager.snapshot_create("parent", "gold").unwrap();
    let summary = manager.clone_volume("parent", "gold", "child").unwrap();
    assert_eq!(
        summary.origin,
        Some(("parent".to_string(), "gold".to_string()))
    );
    let child = manager.open_volume("child").unwrap();
    assert_same_blocks(&read_all(&child), &base, "fresh clone");

    let mut parent_model = base.clone();
    let mut child_model = base.clone();
    parent
        .write(BLOCK, &pattern(11, 2 * BLOCK as usize), false)
        .unwrap();
    parent_model[BLOCK as usize..3 * BLOCK as usize]
        .copy_from_slice(&pattern(11, 2 * BLOCK as usize));
    child
        .write(2 * BLOCK + 100, &pattern(12, 100), false)
        .unwrap();
    child_model[(2 * BLOCK + 100) as usize..(2 * BLOCK + 200) as usize]
        .copy_from_slice(&pattern(12, 100));
    child.trim(10 * BLOCK, 2 * BLOCK).unwrap();
    child_model[(10 * BLOCK) as usize..(12 * BLOCK) as usize].fill(0);
    assert_same_blocks(&read_all(&parent), &parent_model, "parent");
    assert_same_blocks(&read_all(&child), &child_model, "child");
    assert_same_blocks(
        &read_all(&manager.open_snapshot("parent", "gold").unwrap()),
        &base,
        "gold",
    );

    // Clone of a clone.
    manager.snapshot_create("child", "c1").unwrap();
    manager.clone_volume("child", "c1", "grandchild").unwrap();
    let grandchild = manager.open_volume("grandchild").unwrap();
    assert_same_blocks(&read_all(&grandchild), &child_model, "grandchild");
    grandchild
        .write(0, &pattern(13, BLOCK as usize), false)
        .unwrap();
    assert_same_blocks(
        &read_all(&child),
        &child_model,
        "child after grandchild write",
    );

    assert!(matches!(
        manager.snapshot_delete("parent", "gold", &mut |_| {}),
        Err(VolumeError::InUse { .. })
    ));
    assert!(matches!(
        manager.delete("parent", &mut |_| {}),
        Err(VolumeError::InUse { .. })
    ));
    drop((parent, child, grandchild));
    drop(manager);
    // Everything survives a reopen, and deleting from the leaves up is allowed.
    let manager = open_manager(&dir);
    assert_same_blocks(
        &read_all(&manager.open_volume("child").unwrap()),
        &child_model,
        "child reopened",
    );
    manager.delete("grandchild", &mut |_| {}).unwrap();
    manager.delete("child", &mut |_| {}).unwrap();
    manager
        .snapshot_delete("parent", "gold", &mut |_| {})
        .unwrap();
    assert_same_blocks(
        &read_all(&manager.open_volume("parent").unwrap()),
        &parent_model,
        "parent at the end",
    );
}

// Proves rollback restores the snapshot's bytes and size, keeps later snapshots intact, can be
// repeated, and that writes after it land normally.
#[test]
fn rollback_restores_snapshot() {
    let dir = test_dir("rollback");
    let manager = open_manager(&dir);
    manager.create(&VolumeSpec::new("v", SIZE)).unwrap();
    let handle = manager.open_volume("v").unwrap();
    let one = pattern(20, SIZE as usize);
    handle.write(0, &one, false).unwrap();
    manager.snapshot_create("v", "one").unwrap();
    let mut two = one.clone();
    two[..4 * BLOCK as usize].copy_from_slice(&pattern(21, 4 * BLOCK as usize));
    handle.write(0, &two[..4 * BLOCK as usize], false).unwrap();
    manager.snapshot_create("v", "two").unwrap();
    handle.write(0, &pattern(22, SIZE as usize), false).unwrap();
    manager.resize("v", 2 * SIZE, false).unwrap();

    manager.rollback("v", "one").unwrap();
    assert_eq!(handle.size_bytes(), SIZE);
    assert_same_blocks(&read_all(&handle), &one, "rolled back to one");
    assert_same_blocks(
        &read_all(&manager.open_snapshot("v", "two").unwrap()),
        &two,
        "two kept",
    );
    // Writes after the rollback, then a rollback to the newer snapshot.
    handle
        .write(BLOCK * 5, &pattern(23, BLOCK as usize), false)
        .unwrap();
    manager.rollback("v", "two").unwrap();
    assert_same_blocks(&read_all(&handle), &two, "rolled back to two");
    manager.rollback("v", "one").unwrap();
    assert_same_blocks(&read_all(&handle), &one, "rolled back to one again");
    let mut after = one.clone();
    after[..BLOCK as usize].copy_from_slice(&pattern(24, BLOCK as usize));
    handle.write(0, &pattern(24, BLOCK as usize), true).unwrap();
    assert_same_blocks(&read_all(&handle), &after, "written after rollback");
    drop(handle);
    drop(manager);
    let manager = open_manager(&dir);
    assert_same_blocks(
        &read_all(&manager.open_volume("v").unwrap()),
        &after,
        "after reopen",
    );
    // Discarded generations were collected: one copy of the volume, the 4 blocks "two"
    // changed, and the block written after the last rollback.
    assert_eq!(
        manager.info("v").unwrap().stored_bytes,
        SIZE + 4 * BLOCK + BLOCK
    );
}

// Proves deleting a snapshot frees exactly the blocks only it held, and leaves other
// snapshots, clones and the current contents untouched.
#[test]
fn snapshot_delete_frees_only_its_blocks() {
    let dir = test_dir("snapdelete");
    let manager = open_manager(&dir);
    manager.create(&VolumeSpec::new("v", SIZE)).unwrap();
    let handle = manager.open_volume("v").unwrap();
    let a = pattern(30, SIZE as usize);
    handle.write(0, &a, false).unwrap();
    manager.snapshot_create("v", "a").unwrap();
    let mut b = a.clone();
    b[..8 * BLOCK as usize].copy_from_slice(&pattern(31, 8 * BLOCK as usize));
    handle.write(0, &b[..8 * BLOCK as usize], false).unwrap();
    manager.snapshot_create("v", "b").unwrap();
    let mut c = b.clone();
    c[..2 * BLOCK as usize].copy_from_slice(&pattern(32, 2 * BLOCK as usize));
    handle.write(0, &c[..2 * BLOCK as usize], false).unwrap();
    manager.snapshot_create("v", "c").unwrap();
    manager.clone_volume("v", "c", "clone").unwrap();
    let mut current = c.clone();
    current[..BLOCK as usize].copy_from_slice(&pattern(33, BLOCK as usize));
    handle.write(0, &current[..BLOCK as usize], false).unwrap();

    let info = manager.info("v").unwrap();
    // a: 64 blocks; b: 8; c: 2; current: 1.
    assert_eq!(info.stored_bytes, (64 + 8 + 2 + 1) * BLOCK);
    let unique: Vec<u64> = info
        .snapshots
        .iter()
        .map(|snapshot| snapshot.unique_bytes.unwrap() / BLOCK)
        .collect();
    // a alone holds blocks 0..8 of generation 1; b alone its blocks 0..2 (c rewrote them);
    // c alone its block 0 (the current contents rewrote it).
    assert_eq!(unique, vec![8, 2, 1]);

    let report = manager.snapshot_delete("v", "b", &mut |_| {}).unwrap();
    assert_eq!(report.extents_deleted, 2);
    let info = manager.info("v").unwrap();
    assert_eq!(info.stored_bytes, (64 + 8 + 2 + 1 - 2) * BLOCK);
    assert_same_blocks(
        &read_all(&manager.open_snapshot("v", "a").unwrap()),
        &a,
        "a",
    );
    assert_same_blocks(
        &read_all(&manager.open_snapshot("v", "c").unwrap()),
        &c,
        "c",
    );
    assert_same_blocks(
        &read_all(&manager.open_volume("clone").unwrap()),
        &c,
        "clone",
    );
    assert_same_blocks(&read_all(&handle), &current, "current");

    manager.snapshot_delete("v", "a", &mut |_| {}).unwrap();
    assert_eq!(manager.info("v").unwrap().stored_bytes, (64 + 1) * BLOCK);
    assert_same_blocks(
        &read_all(&manager.open_snapshot("v", "c").unwrap()),
        &c,
        "c after a",
    );
    assert_same_blocks(
        &read_all(&manager.open_volume("clone").unwrap()),
        &c,
        "clone after a",
    );
    // A snapshot exported read-only cannot be deleted under its reader.
    let export = manager.open_snapshot("v", "c").unwrap();
    manager.delete("clone", &mut |_| {}).unwrap();
    assert!(matches!(
        manager.snapshot_delete("v", "c", &mut |_| {}),
        Err(VolumeError::InUse { .. })
    ));
    drop(export);
    manager.snapshot_delete("v", "c", &mut |_| {}).unwrap();
    assert_eq!(manager.info("v").unwrap().stored_bytes, 64 * BLOCK);
    assert_same_blocks(&read_all(&handle), &current, "current at the end");
}

// Proves a clone shrunk and grown again reads zeroes where it shrank, never its parent's bytes
// there (the truncation hides the parent's layer too): in one read across both sides of the
// cut, block by block, and in a partial write's read-modify-write.
#[test]
fn a_clone_shrunk_and_grown_reads_zeroes_where_it_shrank() {
    let dir = test_dir("clone-shrunk");
    let manager = open_manager(&dir);
    manager.create(&VolumeSpec::new("parent", SIZE)).unwrap();
    let parent = manager.open_volume("parent").unwrap();
    let base = pattern(20, SIZE as usize);
    parent.write(0, &base, false).unwrap();
    manager.snapshot_create("parent", "gold").unwrap();
    manager.clone_volume("parent", "gold", "child").unwrap();
    let child = manager.open_volume("child").unwrap();
    // Blocks the clone wrote itself, before and past the cut.
    child
        .write(BLOCK, &pattern(21, BLOCK as usize), false)
        .unwrap();
    child
        .write(40 * BLOCK, &pattern(22, BLOCK as usize), false)
        .unwrap();
    manager.resize("child", 32 * BLOCK, true).unwrap();
    manager.resize("child", SIZE, true).unwrap();
    let mut expected = base.clone();
    expected[BLOCK as usize..2 * BLOCK as usize].copy_from_slice(&pattern(21, BLOCK as usize));
    expected[32 * BLOCK as usize..].fill(0);
    assert_same_blocks(&read_all(&child), &expected, "regrown clone");
    // A partial write there merges with zeroes too.
    let at = (33 * BLOCK + 100) as usize;
    child.write(at as u64, &pattern(23, 50), false).unwrap();
    expected[at..at + 50].copy_from_slice(&pattern(23, 50));
    assert_same_blocks(&read_all(&child), &expected, "regrown clone, written to");
    // One read of several blocks, all past the cut.
    let mut past = vec![1u8; 6 * BLOCK as usize];
    child.read(34 * BLOCK, &mut past).unwrap();
    assert!(
        past.iter().all(|&byte| byte == 0),
        "blocks 34-39 read zeroes"
    );
    for block in 28..36u64 {
        let mut one = vec![0u8; BLOCK as usize];
        child.read(block * BLOCK, &mut one).unwrap();
        let at = (block * BLOCK) as usize;
        assert!(
            one == expected[at..at + BLOCK as usize],
            "block {block} of the regrown clone"
        );
    }
    assert_same_blocks(&read_all(&parent), &base, "parent");
}
