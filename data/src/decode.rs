//! Reading and decoding one image file to 8-bit RGB.

use std::io::Cursor;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use image::{ImageFormat, ImageReader, RgbImage};
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;

use crate::DataError;
use crate::scan_index::ScanIndexCache;
use crate::slice_reader::SliceReader;
use crate::transform::CropBox;

/// The file's bytes, or a bad-file error naming it.
fn read_file(path: &Path) -> Result<Vec<u8>, DataError> {
    std::fs::read(path).map_err(|e| bad(path, format!("cannot read: {e}")))
}

fn bad(path: &Path, reason: impl Into<String>) -> DataError {
    DataError::BadImage {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Reads and decodes `path` to RGB (grayscale, CMYK, palette and alpha images are converted, alpha
/// is dropped as PIL's `convert("RGB")` does).
///
/// The format is sniffed from the content, never from the extension, so a PNG named `.JPEG`
/// decodes.
///
/// # Errors
/// [`DataError::BadImage`] naming the file for unreadable (missing, permission denied, a
/// directory), empty, truncated, non-image or undecodable files. Never panics: a panic inside the
/// decoder is caught and reported as a bad file.
pub fn decode_file(path: &Path) -> Result<RgbImage, DataError> {
    let bytes = read_file(path)?;
    decode_bytes(&bytes).map_err(|reason| bad(path, reason))
}

/// What to decode of an image, chosen from the size in its header (see [`decode_file_plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodePlan {
    /// Decode at `1/scale` of the size: 1, or one of the scales the file offers.
    pub scale: u32,
    /// The pixels needed, in the scaled image's coordinates; `None` for all of them.
    pub region: Option<CropBox>,
}

/// An image decoded at `1/scale` of its `full_size` (each side rounded up).
#[derive(Debug, Clone)]
pub struct ScaledImage {
    /// The pixels: `full_size / scale`, rounded up.
    pub image: RgbImage,
    /// 1, 2, 4 or 8.
    pub scale: u32,
    /// Width and height of the image in the file.
    pub full_size: (u32, u32),
}

/// Reads `path` and decodes what `plan` picks from the image's size: the whole image, a region
/// of it, and/or the image at 1/2, 1/4 or 1/8 of its size by DCT-domain downscaling.
///
/// `plan` is called exactly once for a decodable image, before its pixels are decoded, with the
/// width, height and the scales this file can be decoded at (always 1; also 2, 4 and 8 for
/// baseline YCbCr JPEGs whose chroma subsampling allows them). Inside the region the pixels are
/// exactly those of a decode at the same scale without a region; at scale 1, those of
/// [`decode_file`].
///
/// # Errors
/// As [`decode_file`].
pub fn decode_file_plan(
    path: &Path,
    plan: impl FnOnce(u32, u32, &[u32]) -> DecodePlan,
) -> Result<ScaledImage, DataError> {
    decode_file_with(path, plan, None, Vec::new())
}

/// [`decode_file_plan`] for file `file` of a dataset whose scan indexes `cache` keeps: a JPEG
/// decoded at full size starts reading at the marks an earlier decode of the file left (see
/// [`ScanIndexCache`]) and leaves its own. The pixels are those of [`decode_file_plan`].
///
/// # Errors
/// As [`decode_file`].
pub fn decode_file_plan_indexed(
    path: &Path,
    plan: impl FnOnce(u32, u32, &[u32]) -> DecodePlan,
    cache: &ScanIndexCache,
    file: usize,
) -> Result<ScaledImage, DataError> {
    decode_file_with(path, plan, Some((cache, file)), Vec::new())
}

thread_local! {
    /// The last loader sample's pixel buffer, for the next decode on this thread.
    static SPARE_PIXELS: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The loader's decode: [`decode_file_plan_indexed`] (or [`decode_file_plan`] without `index`)
/// into the buffer of this thread's previous sample ([`recycle_pixels`]), so that a decode
/// neither allocates nor zeroes half a megabyte. Outside the region the pixels are what the
/// buffer held.
pub(crate) fn decode_file_for_loader(
    path: &Path,
    plan: impl FnOnce(u32, u32, &[u32]) -> DecodePlan,
    index: Option<(&ScanIndexCache, usize)>,
) -> Result<ScaledImage, DataError> {
    let spare = SPARE_PIXELS.with_borrow_mut(std::mem::take);
    decode_file_with(path, plan, index, spare)
}

/// The file versions of [`decode_plan`]: read, decode, name the file in the error.
fn decode_file_with(
    path: &Path,
    plan: impl FnOnce(u32, u32, &[u32]) -> DecodePlan,
    index: Option<(&ScanIndexCache, usize)>,
    pixels: Vec<u8>,
) -> Result<ScaledImage, DataError> {
    let bytes = read_file(path)?;
    decode_plan(&bytes, plan, index, pixels).map_err(|reason| bad(path, reason))
}

/// Hands a decoded sample's pixels back for this thread's next [`decode_file_for_loader`].
pub(crate) fn recycle_pixels(pixels: Vec<u8>) {
    SPARE_PIXELS.with_borrow_mut(|spare| {
        if pixels.capacity() > spare.capacity() {
            *spare = pixels;
        }
    });
}

/// [`decode_file_plan`] for an in-memory image.
///
/// # Errors
/// As [`decode_bytes`].
pub fn decode_bytes_plan(
    bytes: &[u8],
    plan: impl FnOnce(u32, u32, &[u32]) -> DecodePlan,
) -> Result<ScaledImage, String> {
    decode_plan(bytes, plan, None, Vec::new())
}

/// `pixels`: a buffer to decode a JPEG into (any length, any content).
fn decode_plan(
    bytes: &[u8],
    plan: impl FnOnce(u32, u32, &[u32]) -> DecodePlan,
    index: Option<(&ScanIndexCache, usize)>,
    pixels: Vec<u8>,
) -> Result<ScaledImage, String> {
    // A file an earlier epoch decoded and indexed at this length passed `checked_format`
    // then; its end-of-image walk reads the whole file, 1-2% of a validation epoch.
    let format = if index.is_some_and(|(cache, file)| cache.holds(file, bytes.len())) {
        ImageFormat::Jpeg
    } else {
        checked_format(bytes)?
    };
    let mut plan = Some(plan);
    if format == ImageFormat::Jpeg {
        let direct = catch_unwind(AssertUnwindSafe(|| {
            decode_jpeg_plan(bytes, &mut plan, index, pixels)
        }));
        match direct {
            Ok(Some(img)) => return Ok(img),
            Ok(None) => {}
            Err(_) => return Err("the decoder panicked on this file".into()),
        }
    }
    // Not a colour JPEG zune-jpeg decodes cleanly: the general path gives the same pixels as
    // `decode_bytes` and its error messages.
    let image = decode_checked(bytes, format)?;
    let full_size = image.dimensions();
    if let Some(plan) = plan {
        plan(full_size.0, full_size.1, &[1]);
    }
    Ok(ScaledImage {
        image,
        scale: 1,
        full_size,
    })
}

/// Reads `path` and decodes the pixels of the box `region` picks from the image's size; the
/// rest of the returned image is unspecified.
///
/// `region` is called exactly once for a decodable image, before its pixels are decoded
/// (`RandomResizedCrop` draws its box from the size in the header), and may return `None` for
/// the whole image. Inside the box the pixels are exactly those of [`decode_file`].
///
/// # Errors
/// As [`decode_file`].
pub fn decode_file_region(
    path: &Path,
    region: impl FnOnce(u32, u32) -> Option<CropBox>,
) -> Result<RgbImage, DataError> {
    let bytes = read_file(path)?;
    decode_bytes_region(&bytes, region).map_err(|reason| bad(path, reason))
}

/// [`decode_file_region`] for an in-memory image.
///
/// Only baseline colour JPEGs (YCbCr, what cameras and ImageNet hold) decode less than the
/// whole image: the patched zune-jpeg skips the transforms of blocks outside the box and stops
/// after its last row. Every other image is decoded whole, then `region` is asked.
///
/// # Errors
/// As [`decode_bytes`].
pub fn decode_bytes_region(
    bytes: &[u8],
    region: impl FnOnce(u32, u32) -> Option<CropBox>,
) -> Result<RgbImage, String> {
    decode_bytes_plan(bytes, |w, h, _| DecodePlan {
        scale: 1,
        region: region(w, h),
    })
    .map(|decoded| decoded.image)
}

/// The plan's decode of a YCbCr JPEG, with the options `image` gives zune-jpeg (lenient, no size
/// limit, RGB out) so that the pixels are the same. `None`, with `plan` not taken, for any
/// other colour space or any error, which the general path then reports.
fn decode_jpeg_plan(
    bytes: &[u8],
    plan: &mut Option<impl FnOnce(u32, u32, &[u32]) -> DecodePlan>,
    index: Option<(&ScanIndexCache, usize)>,
    mut pixels: Vec<u8>,
) -> Option<ScaledImage> {
    let options = DecoderOptions::default()
        .set_strict_mode(false)
        .set_max_width(usize::MAX)
        .set_max_height(usize::MAX)
        .jpeg_set_out_colorspace(ColorSpace::RGB);
    let mut decoder = zune_jpeg::JpegDecoder::new_with_options(SliceReader::new(bytes), options);
    decoder.decode_headers().ok()?;
    if decoder.input_colorspace()? != ColorSpace::YCbCr {
        return None;
    }
    let (width, height) = decoder.dimensions()?;
    let (w, h) = (u32::try_from(width).ok()?, u32::try_from(height).ok()?);
    if w == 0 || h == 0 {
        return None;
    }
    let mut scales = vec![1];
    for s in [2, 4, 8] {
        decoder.set_scale(s);
        if decoder.scale() == s {
            scales.push(s as u32);
        }
    }
    let pick = plan.take()?;
    let chosen = pick(w, h, &scales);
    let scale = if scales.contains(&chosen.scale) {
        chosen.scale
    } else {
        1
    };
    decoder.set_scale(scale as usize);
    if let Some(b) = chosen.region {
        decoder.set_region(
            b.left as usize,
            b.top as usize,
            b.width as usize,
            b.height as usize,
        );
    }
    let (out_w, out_h) = decoder.output_dimensions()?;
    let (out_w, out_h) = (u32::try_from(out_w).ok()?, u32::try_from(out_h).ok()?);
    // The marks are entry points into the scan at full size; a scaled decode reads it whole.
    let index = index.filter(|_| scale == 1);
    if let Some((cache, file)) = index {
        decoder.use_scan_index(cache.take(file, bytes.len()));
    }
    // Only what an earlier decode did not cover is zeroed.
    pixels.resize(decoder.output_buffer_size()?, 0);
    let decoded = decoder.decode_into(&mut pixels);
    if let (Some((cache, file)), Ok(())) = (index, &decoded)
        && let Some(marks) = decoder.take_scan_index()
    {
        cache.put(file, bytes.len(), marks);
    }
    match decoded {
        Ok(()) => Some(ScaledImage {
            image: RgbImage::from_raw(out_w, out_h, pixels)?,
            scale,
            full_size: (w, h),
        }),
        // The box was drawn; a file that fails here fails on every path, so report it as the
        // general path words it.
        Err(_) => None,
    }
}

/// Decodes an in-memory image to RGB; on failure returns the reason.
///
/// # Errors
/// A human-readable reason when the bytes are empty, not a JPEG or PNG, truncated or corrupt.
pub fn decode_bytes(bytes: &[u8]) -> Result<RgbImage, String> {
    decode_checked(bytes, checked_format(bytes)?)
}

/// The format of a non-empty JPEG or PNG, a JPEG checked for truncation; or why the bytes are
/// not one.
fn checked_format(bytes: &[u8]) -> Result<ImageFormat, String> {
    if bytes.is_empty() {
        return Err("the file is empty (0 bytes)".into());
    }
    let format = image::guess_format(bytes)
        .map_err(|_| "not a JPEG or PNG file (unknown magic bytes)".to_string())?;
    match format {
        ImageFormat::Jpeg => {
            // zune-jpeg runs in lenient mode inside `image` and fills a truncated scan with grey;
            // PIL (and so torchvision) rejects such files, so do we.
            jpeg_end_of_image(bytes)?;
        }
        ImageFormat::Png => {}
        other => {
            return Err(format!(
                "unsupported image format {other:?} (expected JPEG or PNG)"
            ));
        }
    }
    Ok(format)
}

/// Decodes bytes [`checked_format`] accepted as `format`, through `image`.
fn decode_checked(bytes: &[u8], format: ImageFormat) -> Result<RgbImage, String> {
    let decoded = catch_unwind(AssertUnwindSafe(|| {
        let mut reader = ImageReader::new(Cursor::new(bytes));
        reader.set_format(format);
        reader.decode().map(|img| img.into_rgb8())
    }));
    match decoded {
        Ok(Ok(img)) if img.width() > 0 && img.height() > 0 => Ok(img),
        Ok(Ok(_)) => Err("the image has zero width or height".into()),
        Ok(Err(e)) => Err(format!("decoder error: {e}")),
        Err(_) => Err("the decoder panicked on this file".into()),
    }
}

/// Walks a JPEG's marker segments from start-of-image to its end-of-image marker and returns the
/// offset just past it, or why the file is incomplete.
///
/// Segments are skipped by their length, so an end-of-image marker inside one (the thumbnail JPEG
/// of an EXIF block) does not count; entropy-coded data is scanned to the next real marker
/// (`FF 00` is a stuffed byte, `FF D0`..`FF D7` restart markers), so progressive files with many
/// scans are followed to their end. A second start-of-image marker before the end means a cut
/// image with other data appended, and is refused too. Whatever follows the end of the image (phone cameras append
/// depth maps and vendor data) is ignored, as libjpeg and PIL ignore it. Stray bytes between
/// segments are skipped like libjpeg does (it only warns about them).
///
/// # Errors
/// A reason naming the byte offset where the file ends too early.
pub fn jpeg_end_of_image(bytes: &[u8]) -> Result<usize, String> {
    let truncated = |at: usize| {
        format!(
            "truncated JPEG (the file ends at byte {} before the end-of-image marker, at {at})",
            bytes.len()
        )
    };
    if !bytes.starts_with(&[0xFF, 0xD8]) {
        return Err("not a JPEG file (no start-of-image marker)".into());
    }
    let mut at = 2;
    loop {
        // The next marker: stray bytes, then any number of 0xFF fill bytes, then the code.
        let ff =
            memchr::memchr(0xFF, &bytes[at.min(bytes.len())..]).ok_or_else(|| truncated(at))?;
        at += ff;
        while bytes.get(at) == Some(&0xFF) {
            at += 1;
        }
        let marker = *bytes.get(at).ok_or_else(|| truncated(at))?;
        at += 1;
        match marker {
            0xD9 => return Ok(at),
            // A new image before this one ended: this one was cut and something appended.
            0xD8 => {
                return Err(format!(
                    "truncated JPEG (another image starts at byte {} before this one's \
                     end-of-image marker)",
                    at - 2
                ));
            }
            // Standalone markers (TEM, RSTn) and a stuffed zero outside a scan carry no length.
            0x00 | 0x01 | 0xD0..=0xD7 => continue,
            _ => {}
        }
        let len_bytes = bytes.get(at..at + 2).ok_or_else(|| truncated(at))?;
        let len = usize::from(u16::from_be_bytes([len_bytes[0], len_bytes[1]]));
        if len < 2 {
            return Err(format!(
                "corrupt JPEG (segment FF {marker:02X} at byte {} has length {len})",
                at - 2
            ));
        }
        at += len;
        if at > bytes.len() {
            return Err(truncated(at));
        }
        if marker == 0xDA {
            // Entropy-coded data follows the scan header, up to the next marker that is not a
            // stuffed byte (FF 00) or a restart marker.
            loop {
                let ff =
                    memchr::memchr(0xFF, &bytes[at..]).ok_or_else(|| truncated(bytes.len()))?;
                at += ff;
                match bytes.get(at + 1) {
                    None => return Err(truncated(at + 1)),
                    Some(0x00 | 0xD0..=0xD7) => at += 2,
                    Some(_) => break,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_empty_and_garbage() {
        assert!(
            decode_bytes(&[])
                .expect_err("empty input")
                .contains("empty")
        );
        assert!(decode_bytes(b"hello world, not an image").is_err());
    }

    /// SOI, an APP1 segment holding `payload`, a scan header, `scan` as entropy-coded data, EOI.
    fn skeleton(payload: &[u8], scan: &[u8]) -> Vec<u8> {
        let mut out = vec![0xFF, 0xD8, 0xFF, 0xE1];
        out.extend_from_slice(&((payload.len() + 2) as u16).to_be_bytes());
        out.extend_from_slice(payload);
        out.extend_from_slice(&[0xFF, 0xDA, 0x00, 0x08, 1, 1, 0, 0, 63, 0]);
        out.extend_from_slice(scan);
        out.extend_from_slice(&[0xFF, 0xD9]);
        out
    }

    #[test]
    fn the_marker_walk_finds_the_real_end_of_image() {
        // An end-of-image marker inside the APP1 segment and stuffed bytes and restart markers
        // inside the scan do not end the image.
        let scan = [0x12, 0xFF, 0x00, 0x34, 0xFF, 0xD3, 0x56];
        let file = skeleton(&[0xFF, 0xD8, 0xAA, 0xFF, 0xD9], &scan);
        assert_eq!(jpeg_end_of_image(&file), Ok(file.len()));
        let mut with_trailer = file.clone();
        with_trailer.extend(std::iter::repeat_n(0xAB, 70_000));
        assert_eq!(jpeg_end_of_image(&with_trailer), Ok(file.len()));
        // Cut anywhere before the last byte: truncated, even though the APP1 payload holds FF D9.
        for cut in [3, 6, 11, file.len() - 4, file.len() - 1] {
            let error = jpeg_end_of_image(&file[..cut]).expect_err("truncated");
            assert!(error.starts_with("truncated JPEG"), "cut {cut}: {error}");
        }
        // Fill bytes before a marker are allowed.
        let mut filled = file.clone();
        filled.splice(2..2, [0xFF, 0xFF]);
        assert_eq!(jpeg_end_of_image(&filled), Ok(filled.len()));
    }
}
