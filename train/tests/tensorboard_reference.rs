//! Our TensorBoard event files against torch's `SummaryWriter` (fixtures made by
//! `fixtures/make_tensorboard_fixture.py`): our reader reads torch's file (its CRCs are
//! TensorBoard's, not ours), and the file our writer makes for the same scalars holds the same
//! records, byte for byte once the wall times are set aside.

mod common;

use std::path::Path;

use train::tensorboard::{SummaryWriter, read_scalars};

struct Reference {
    scalars: Vec<(String, f32, i64)>,
}

fn reference() -> Reference {
    let text = std::fs::read_to_string(common::fixtures().join("tensorboard_reference.json"))
        .expect("tensorboard_reference.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("json");
    let scalars = json["scalars"]
        .as_array()
        .expect("scalars")
        .iter()
        .map(|s| {
            (
                s[0].as_str().expect("tag").to_string(),
                s[1].as_f64().expect("value") as f32,
                s[2].as_i64().expect("step"),
            )
        })
        .collect();
    Reference { scalars }
}

/// The payloads of a TFRecord file (length, masked CRC, data, masked CRC), read here without our
/// reader's code.
fn records(path: &Path) -> Vec<Vec<u8>> {
    let bytes = std::fs::read(path).expect("event file");
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let len = u64::from_le_bytes(bytes[at..at + 8].try_into().expect("length")) as usize;
        out.push(bytes[at + 12..at + 12 + len].to_vec());
        at += 16 + len;
    }
    assert_eq!(at, bytes.len(), "{}: trailing bytes", path.display());
    out
}

/// The top-level protobuf fields of `data` as `(number, wire type, raw bytes of the field)`.
fn fields(data: &[u8]) -> Vec<(u64, u64, Vec<u8>)> {
    fn varint(data: &[u8], at: &mut usize) -> u64 {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = data[*at];
            *at += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                break;
            }
        }
        value
    }
    let mut out = Vec::new();
    let mut at = 0;
    while at < data.len() {
        let start = at;
        let key = varint(data, &mut at);
        match key & 7 {
            0 => {
                varint(data, &mut at);
            }
            1 => at += 8,
            2 => {
                let len = varint(data, &mut at) as usize;
                at += len;
            }
            5 => at += 4,
            other => panic!("wire type {other}"),
        }
        out.push((key >> 3, key & 7, data[start..at].to_vec()));
    }
    out
}

/// An `Event` without its `wall_time` (field 1), the one field that must differ.
fn without_wall_time(event: &[u8]) -> Vec<(u64, u64, Vec<u8>)> {
    let fields = fields(event);
    assert_eq!(
        fields.first().map(|f| (f.0, f.1)),
        Some((1, 1)),
        "an Event starts with its wall_time (a double)"
    );
    fields.into_iter().skip(1).collect()
}

#[test]
fn our_reader_reads_the_scalars_torchs_summary_writer_wrote() {
    let reference = reference();
    let scalars = read_scalars(&common::fixtures().join("torch_summary_writer.tfevents"))
        .expect("our reader accepts torch's file, CRCs included");
    let read: Vec<(String, f32, i64)> = scalars
        .into_iter()
        .map(|s| (s.tag, s.value, s.step))
        .collect();
    assert_eq!(read.len(), reference.scalars.len());
    for (ours, theirs) in read.iter().zip(&reference.scalars) {
        assert_eq!(ours.0, theirs.0);
        assert_eq!(ours.1.to_bits(), theirs.1.to_bits(), "{}", ours.0);
        assert_eq!(ours.2, theirs.2, "{}", ours.0);
    }
}

#[test]
fn our_writer_writes_torchs_records_for_the_same_scalars() {
    let reference = reference();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = {
        let mut writer = SummaryWriter::new(dir.path()).expect("writer");
        for (tag, value, step) in &reference.scalars {
            writer.add_scalar(tag, *value, *step).expect("scalar");
        }
        writer.flush().expect("flush");
        writer.path().to_path_buf()
    };
    let ours = records(&path);
    let theirs = records(&common::fixtures().join("torch_summary_writer.tfevents"));
    assert_eq!(ours.len(), theirs.len(), "record count");

    // The file-version record: the same version string. torch also names its writer in
    // `source_metadata` (field 10), which TensorFlow's own writer leaves out; so do we.
    let version = |event: &[u8]| {
        without_wall_time(event)
            .into_iter()
            .filter(|f| f.0 != 10)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        version(&ours[0]),
        version(&theirs[0]),
        "file version record"
    );

    // Every scalar record, byte for byte after the wall time.
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate().skip(1) {
        assert_eq!(
            without_wall_time(a),
            without_wall_time(b),
            "record {i} ({:?})",
            reference.scalars[i - 1]
        );
    }

    // And our framing: torch's reader side is TensorBoard's; the CRCs of our records must be the
    // ones TensorBoard computes (checked against its values in the masked-CRC test), so here the
    // file must also read back through our reader.
    assert_eq!(
        read_scalars(&path).expect("read back").len(),
        reference.scalars.len()
    );
}
