//! Decoding real JPEG/PNG files (Pillow fixtures) and rejecting bad ones.

mod common;

use data::{DataError, decode_file};

/// Reads the SOF marker: (progressive, per-component (h, v) sampling factors).
fn sof_info(bytes: &[u8]) -> (bool, Vec<(u8, u8)>) {
    let mut i = 2;
    while i + 4 < bytes.len() {
        assert_eq!(bytes[i], 0xFF, "marker expected at {i}");
        let marker = bytes[i + 1];
        let len = usize::from(bytes[i + 2]) << 8 | usize::from(bytes[i + 3]);
        if marker == 0xC0 || marker == 0xC2 {
            let n = usize::from(bytes[i + 9]);
            let comps = (0..n)
                .map(|c| {
                    let s = bytes[i + 11 + 3 * c];
                    (s >> 4, s & 0xF)
                })
                .collect();
            return (marker == 0xC2, comps);
        }
        i += 2 + len;
    }
    panic!("no SOF marker");
}

fn assert_colour(path: &str, want: [u8; 3], tol: i32) {
    let img = decode_file(&common::fixtures().join(path)).expect(path);
    assert_eq!(img.dimensions(), (40, 24), "{path}: size");
    for (x, y) in [(0, 0), (20, 12), (39, 23)] {
        let p = img.get_pixel(x, y).0;
        for c in 0..3 {
            assert!(
                (i32::from(p[c]) - i32::from(want[c])).abs() <= tol,
                "{path}: pixel ({x},{y}) = {p:?}, want {want:?}"
            );
        }
    }
}

#[test]
fn fixtures_have_the_claimed_encoding() {
    let read = |f: &str| std::fs::read(common::fixtures().join(f)).expect(f);
    assert_eq!(
        sof_info(&read("baseline_420.jpg")),
        (false, vec![(2, 2), (1, 1), (1, 1)])
    );
    assert_eq!(
        sof_info(&read("baseline_444.jpg")),
        (false, vec![(1, 1), (1, 1), (1, 1)])
    );
    assert_eq!(
        sof_info(&read("progressive_420.jpg")),
        (true, vec![(2, 2), (1, 1), (1, 1)])
    );
    assert_eq!(
        sof_info(&read("progressive_444.jpg")),
        (true, vec![(1, 1), (1, 1), (1, 1)])
    );
    assert_eq!(sof_info(&read("grayscale.jpg")).1.len(), 1);
    assert_eq!(sof_info(&read("cmyk.jpg")).1.len(), 4);
    assert_eq!(&read("png_named.JPEG")[..4], b"\x89PNG");
}

#[test]
fn good_files_decode_to_right_size_and_colour() {
    let red = [200, 40, 60];
    for f in [
        "baseline_420.jpg",
        "baseline_444.jpg",
        "progressive_420.jpg",
        "progressive_444.jpg",
    ] {
        assert_colour(f, red, 4);
    }
    assert_colour("grayscale.jpg", [120, 120, 120], 3);
    assert_colour("cmyk.jpg", red, 6);
    assert_colour("png_named.JPEG", red, 0);
}

fn assert_bad(path: &std::path::Path, reason_has: &str) {
    match decode_file(path) {
        Err(DataError::BadImage { path: p, reason }) => {
            assert_eq!(p, path);
            assert!(
                reason.contains(reason_has),
                "reason {reason:?} lacks {reason_has:?}"
            );
            let msg = DataError::BadImage { path: p, reason }.to_string();
            assert!(msg.contains(&path.display().to_string()), "{msg}");
        }
        other => panic!("{}: expected BadImage, got {other:?}", path.display()),
    }
}

#[test]
fn bad_files_are_errors_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();

    let empty = d.join("empty.JPEG");
    std::fs::write(&empty, b"").expect("write");
    assert_bad(&empty, "empty");

    let good = d.join("good.jpg");
    common::write_jpeg(&good, 64, 48, 1);
    let bytes = std::fs::read(&good).expect("read");
    let truncated = d.join("truncated.jpg");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).expect("write");
    assert_bad(&truncated, "truncated");

    // Deterministic pseudo-random bytes.
    let mut s = 0x1234_5678_u32;
    let noise: Vec<u8> = (0..4096)
        .map(|_| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (s >> 24) as u8
        })
        .collect();
    let random = d.join("random.jpg");
    std::fs::write(&random, &noise).expect("write");
    assert_bad(&random, "not a JPEG or PNG");

    // A JPEG header followed by garbage.
    let mut corrupt = bytes[..200.min(bytes.len())].to_vec();
    corrupt.extend_from_slice(&noise);
    corrupt.extend_from_slice(&[0xFF, 0xD9]);
    let corrupt_path = d.join("corrupt.jpg");
    std::fs::write(&corrupt_path, &corrupt).expect("write");
    assert!(decode_file(&corrupt_path).is_err());

    // Unreadable: a directory named like an image (works as root too) ...
    let as_dir = d.join("folder.jpg");
    std::fs::create_dir(&as_dir).expect("mkdir");
    assert_bad(&as_dir, "cannot read");
    // ... and a missing file.
    assert_bad(&d.join("missing.jpg"), "cannot read");
}

/// Files that cannot be read, in forms root cannot read either (CI runs as root, which reads a
/// 0o000 file): a directory named like an image, and an image removed after the folder was
/// scanned.
#[test]
fn unreadable_files_are_bad_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let folder = dir.path().join("photos.jpg");
    std::fs::create_dir(&folder).expect("mkdir");
    assert_bad(&folder, "cannot read");

    let classes = dir.path().join("set");
    let gone = classes.join("a/vanished.jpg");
    std::fs::create_dir_all(gone.parent().expect("class dir")).expect("mkdir");
    common::write_jpeg(&gone, 16, 16, 0);
    let scanned = data::ImageFolder::new(&classes).expect("scan");
    assert_eq!(scanned.samples()[0].path, gone);
    std::fs::remove_file(&gone).expect("remove");
    assert_bad(&scanned.samples()[0].path, "cannot read");
}

#[test]
fn a_phone_photo_with_a_64_kib_trailer_decodes() {
    // Pillow's JPEG with an EXIF thumbnail (its own FF D9 inside APP1) and 64 KiB of embedded data
    // after the end of the image, as phone cameras write.
    let path = common::fixtures().join("photos/phone_trailer.jpg");
    let bytes = std::fs::read(&path).expect("fixture");
    // The old check looked for FF D9 in the last 4 KiB only; this file has none there.
    assert!(
        !bytes[bytes.len() - 4096..]
            .windows(2)
            .any(|w| w == [0xFF, 0xD9])
    );
    let end = data::jpeg_end_of_image(&bytes).expect("complete image");
    assert_eq!(bytes.len() - end, 65536, "the trailer is 64 KiB");
    let image = decode_file(&path).expect("decodes");
    assert_eq!(image.dimensions(), (500, 375));

    // Cut inside the main image's scan: truncated, although the EXIF thumbnail and the trailer
    // both hold FF D9 markers.
    let dir = tempfile::tempdir().expect("tempdir");
    for keep in [end / 2, end - 2] {
        let cut = dir.path().join(format!("cut_{keep}.jpg"));
        let mut truncated = bytes[..keep].to_vec();
        truncated.extend_from_slice(&bytes[end..]);
        std::fs::write(&cut, &truncated).expect("write");
        assert_bad(&cut, "truncated");
        std::fs::write(&cut, &bytes[..keep]).expect("write");
        assert_bad(&cut, "truncated");
    }
}

/// The Huffman tables of a file's DHT segments: (class and id byte, the 16 code counts, the
/// symbols).
fn huffman_tables(bytes: &[u8]) -> Vec<(u8, Vec<u8>, Vec<u8>)> {
    let mut tables = Vec::new();
    let mut i = 2;
    while i + 4 <= bytes.len() && bytes[i] == 0xFF && bytes[i + 1] != 0xDA {
        let len = usize::from(bytes[i + 2]) << 8 | usize::from(bytes[i + 3]);
        if bytes[i + 1] == 0xC4 {
            let mut segment = &bytes[i + 4..i + 2 + len];
            while !segment.is_empty() {
                let counts = segment[1..17].to_vec();
                let symbols = counts.iter().map(|&c| usize::from(c)).sum::<usize>();
                tables.push((segment[0], counts, segment[17..17 + symbols].to_vec()));
                segment = &segment[17 + symbols..];
            }
        }
        i += 2 + len;
    }
    tables
}

/// The decoder keeps the Huffman tables it built last, per thread (vendored zune-jpeg's cache).
/// Files that each carry their own tables, some with the same code counts and different symbols,
/// decoded one after another on one thread in several orders, give the pixels a fresh thread
/// (an empty cache) gives them.
#[test]
fn files_with_their_own_huffman_tables_decode_alike_on_a_busy_thread_and_a_fresh_one() {
    let mut optimized = std::fs::read_dir(common::fixtures().join("huffman"))
        .expect("fixture folder")
        .map(|e| e.expect("fixture entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "jpg"))
        .collect::<Vec<_>>();
    optimized.sort();
    assert_eq!(optimized.len(), 3, "fixtures missing: {optimized:?}");

    // The fixtures hold what the test needs: tables that agree on their code counts and differ
    // in their symbols, the case a cache keyed on less than the whole table would get wrong.
    let tables = optimized
        .iter()
        .flat_map(|p| huffman_tables(&std::fs::read(p).expect("fixture")))
        .collect::<Vec<_>>();
    assert!(
        tables.iter().any(|(class, counts, symbols)| tables
            .iter()
            .any(|(c, n, s)| c == class && n == counts && s != symbols)),
        "no two fixture tables share their code counts with different symbols"
    );

    let files = optimized
        .into_iter()
        .chain(common::jpeg_fixtures())
        .collect::<Vec<_>>();
    let fresh = files
        .iter()
        .map(|path| {
            let path = path.clone();
            std::thread::spawn(move || decode_file(&path).expect("decodes"))
                .join()
                .expect("decode thread")
        })
        .collect::<Vec<_>>();
    let forward = (0..files.len()).collect::<Vec<_>>();
    let backward = forward.iter().rev().copied().collect::<Vec<_>>();
    let interleaved = forward
        .iter()
        .map(|i| (i * 5) % files.len())
        .collect::<Vec<_>>();
    for order in [forward, backward, interleaved] {
        for i in order {
            let image = decode_file(&files[i]).expect("decodes");
            assert!(
                image == fresh[i],
                "{} decodes differently after other files on the same thread",
                common::file_name(&files[i])
            );
        }
    }
}
