//! The cached ImageFolder index: read when it still describes the tree, rescanned when a folder
//! changed, never an error when the cache itself is unusable.

mod common;

use std::path::Path;

use data::{ImageFolder, IndexSource};

/// `with_index` and a plain scan see the same dataset.
fn assert_same(cached: &ImageFolder, root: &Path) {
    let scanned = ImageFolder::new(root).expect("scan");
    assert_eq!(cached.classes(), scanned.classes());
    assert_eq!(cached.samples(), scanned.samples());
}

/// Folder modification times have a granularity; a change right after a write must still show.
fn later() {
    std::thread::sleep(std::time::Duration::from_millis(20));
}

#[test]
fn the_first_open_scans_and_writes_the_next_reads_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("train");
    common::make_folder(&root, &["n02", "n01", "B"], 3);
    let index_dir = dir.path().join("index");

    let (first, source) = ImageFolder::with_index(&root, &index_dir).expect("first open");
    let IndexSource::Scanned(index) = source else {
        panic!("first open: {source:?}")
    };
    assert!(index.is_file());
    assert_same(&first, &root);
    let (second, source) = ImageFolder::with_index(&root, &index_dir).expect("second open");
    assert_eq!(source, IndexSource::Read(index));
    assert_same(&second, &root);
    assert_eq!(second.root(), root.as_path());
}

#[test]
fn an_added_removed_or_renamed_file_or_class_makes_the_index_stale() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("train");
    common::make_folder(&root, &["a", "b"], 2);
    let index_dir = dir.path().join("index");
    let open = || ImageFolder::with_index(&root, &index_dir).expect("open");
    open();
    type Change<'a> = (&'a str, Box<dyn Fn() + 'a>);
    let changes: [Change; 4] = [
        (
            "file added",
            Box::new(|| common::write_jpeg(&root.join("b/new.jpg"), 8, 8, 1)),
        ),
        (
            "file removed",
            Box::new(|| std::fs::remove_file(root.join("a/img_000.jpg")).expect("rm")),
        ),
        (
            "file renamed",
            Box::new(|| {
                std::fs::rename(root.join("a/img_001.jpg"), root.join("a/z.jpg")).expect("mv")
            }),
        ),
        (
            "class added",
            Box::new(|| common::make_folder(&root, &["c"], 1)),
        ),
    ];
    for (what, change) in changes {
        later();
        change();
        let (folder, source) = open();
        assert!(
            matches!(source, IndexSource::Scanned(_)),
            "{what}: {source:?}"
        );
        assert_same(&folder, &root);
        let (_, source) = open();
        assert!(
            matches!(source, IndexSource::Read(_)),
            "{what}, reopened: {source:?}"
        );
    }
}

#[test]
fn a_damaged_or_foreign_index_is_rescanned_and_an_unwritable_one_only_costs_the_cache() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("train");
    common::make_folder(&root, &["a", "b"], 2);
    let index_dir = dir.path().join("index");
    let (_, source) = ImageFolder::with_index(&root, &index_dir).expect("open");
    let IndexSource::Scanned(index) = source else {
        panic!("{source:?}")
    };
    let whole = std::fs::read(&index).expect("read the index");
    for damaged in [
        &whole[..whole.len() - 1],
        &whole[..20],
        b"not an index".as_slice(),
    ] {
        std::fs::write(&index, damaged).expect("damage");
        let (folder, source) = ImageFolder::with_index(&root, &index_dir).expect("open");
        assert_eq!(source, IndexSource::Scanned(index.clone()));
        assert_same(&folder, &root);
    }

    // The index folder is a file: nothing can be written there, the scan still serves.
    let blocked = dir.path().join("blocked");
    std::fs::write(&blocked, b"").expect("write");
    let (folder, source) = ImageFolder::with_index(&root, &blocked).expect("open");
    let IndexSource::ScannedNotCached(why) = source else {
        panic!("{source:?}")
    };
    assert!(why.contains("blocked"), "{why}");
    assert_same(&folder, &root);
}

#[test]
fn processes_opening_at_once_scan_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("train");
    common::make_folder(&root, &["a", "b", "c"], 4);
    let index_dir = dir.path().join("index");
    let sources: Vec<IndexSource> = std::thread::scope(|s| {
        let opens: Vec<_> = (0..6)
            .map(|_| s.spawn(|| ImageFolder::with_index(&root, &index_dir).expect("open").1))
            .collect();
        opens
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    });
    let scanned = sources
        .iter()
        .filter(|s| matches!(s, IndexSource::Scanned(_)))
        .count();
    assert_eq!(scanned, 1, "{sources:?}");
    assert!(
        sources
            .iter()
            .all(|s| matches!(s, IndexSource::Scanned(_) | IndexSource::Read(_))),
        "{sources:?}"
    );
}

#[test]
fn a_missing_root_is_the_same_error_as_without_the_index() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("nope");
    let error = ImageFolder::with_index(&missing, &dir.path().join("index"))
        .expect_err("missing root")
        .to_string();
    assert_eq!(
        error,
        ImageFolder::new(&missing).expect_err("missing").to_string()
    );
}
