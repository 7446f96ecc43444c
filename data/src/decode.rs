//! Reading and decoding one image file to 8-bit RGB.

use std::io::Cursor;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use image::{ImageFormat, ImageReader, RgbImage};

use crate::DataError;

/// How many trailing bytes of a JPEG are searched for the end-of-image marker.
const EOI_SEARCH_WINDOW: usize = 4096;

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
    let bytes = std::fs::read(path).map_err(|e| bad(path, format!("cannot read: {e}")))?;
    decode_bytes(&bytes).map_err(|reason| bad(path, reason))
}

/// Decodes an in-memory image to RGB; on failure returns the reason.
///
/// # Errors
/// A human-readable reason when the bytes are empty, not a JPEG or PNG, truncated or corrupt.
pub fn decode_bytes(bytes: &[u8]) -> Result<RgbImage, String> {
    if bytes.is_empty() {
        return Err("the file is empty (0 bytes)".into());
    }
    let format = image::guess_format(bytes)
        .map_err(|_| "not a JPEG or PNG file (unknown magic bytes)".to_string())?;
    match format {
        ImageFormat::Jpeg => {
            // zune-jpeg runs in lenient mode inside `image` and fills a truncated scan with grey;
            // PIL (and so torchvision) rejects such files, so do we. Entropy-coded data never
            // contains FF D9, so a missing end-of-image marker means a truncated file.
            let tail = &bytes[bytes.len().saturating_sub(EOI_SEARCH_WINDOW)..];
            if !tail.windows(2).any(|w| w == [0xFF, 0xD9]) {
                return Err("truncated JPEG (no end-of-image marker)".into());
            }
        }
        ImageFormat::Png => {}
        other => {
            return Err(format!(
                "unsupported image format {other:?} (expected JPEG or PNG)"
            ));
        }
    }
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
}
