//! ImageFolder scanning: torchvision's class order, sorting, extensions and errors.

mod common;

use data::{DataError, ImageFolder};

#[test]
fn classes_and_files_follow_torchvision_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    // Byte-wise sort: uppercase before lowercase, as Python's sorted().
    common::make_folder(root, &["n02", "n01", "B", "a"], 2);
    common::write_jpeg(&root.join("n01/Z_upper.JPEG"), 20, 20, 0);
    common::write_jpeg(&root.join("n01/a_lower.JpG"), 20, 20, 0);
    std::fs::write(root.join("n01/notes.txt"), b"not an image").expect("write");
    std::fs::write(root.join("README"), b"stray file at the root").expect("write");

    let f = ImageFolder::new(root).expect("scan");
    assert_eq!(f.classes(), ["B", "a", "n01", "n02"]);
    assert_eq!(f.class_to_idx()["n01"], 2);
    assert_eq!(f.len(), 4 * 2 + 2);
    let n01: Vec<String> = f
        .samples()
        .iter()
        .filter(|s| s.label == 2)
        .map(|s| {
            s.path
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    assert_eq!(
        n01,
        ["Z_upper.JPEG", "a_lower.JpG", "img_000.jpg", "img_001.jpg"]
    );
    let labels: Vec<usize> = f.samples().iter().map(|s| s.label).collect();
    assert!(labels.windows(2).all(|w| w[0] <= w[1]), "grouped by class");
}

#[test]
fn missing_root_names_the_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("nope");
    match ImageFolder::new(&missing) {
        Err(e @ DataError::MissingRoot { .. }) => {
            assert!(e.to_string().contains(&missing.display().to_string()));
        }
        other => panic!("expected MissingRoot, got {other:?}"),
    }
}

#[test]
fn root_without_class_folders_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    common::write_jpeg(&dir.path().join("loose.jpg"), 16, 16, 0);
    match ImageFolder::new(dir.path()) {
        Err(DataError::NoClassFolders { path }) => assert_eq!(path, dir.path()),
        other => panic!("expected NoClassFolders, got {other:?}"),
    }
}

#[test]
fn class_folder_without_images_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    common::make_folder(dir.path(), &["a", "c"], 1);
    std::fs::create_dir(dir.path().join("b")).expect("mkdir");
    std::fs::write(dir.path().join("b/x.txt"), b"x").expect("write");
    match ImageFolder::new(dir.path()) {
        Err(e @ DataError::EmptyClassFolder { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains(&dir.path().join("b").display().to_string()),
                "{msg}"
            );
            assert!(msg.contains(".jpg"), "{msg}");
        }
        other => panic!("expected EmptyClassFolder, got {other:?}"),
    }
}
