//! The JPEG decoder's input: an in-memory file read with fixed-size copies.
//!
//! zune-core's `ZCursor` reaches the decoder through its `std::io::Read` impl: every refill of
//! the bit reader (4 bytes, every few coefficients) becomes a variable-length `memcpy` call
//! and a `Result` built and dropped, ~3% of a decode. Here the trait's methods are small
//! enough to inline, so a 4-byte read is a load. Same semantics as `ZCursor` under `std`: a
//! read past the end copies what is there and does not move past the end, a failed exact read
//! copies what is there and does not move, a seek may go past the end.

use zune_core::bytestream::{ZByteIoError, ZByteReaderTrait, ZSeekFrom};

/// `bytes` and a read position.
pub(crate) struct SliceReader<'a> {
    bytes: &'a [u8],
    position: usize,
}

impl<'a> SliceReader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, position: 0 }
    }

    /// The bytes from the position on (empty past the end).
    #[inline(always)]
    fn rest(&self) -> &'a [u8] {
        self.bytes.get(self.position..).unwrap_or_default()
    }
}

impl ZByteReaderTrait for SliceReader<'_> {
    #[inline(always)]
    fn read_byte_no_error(&mut self) -> u8 {
        match self.rest().first() {
            Some(&b) => {
                self.position += 1;
                b
            }
            None => 0,
        }
    }

    #[inline(always)]
    fn read_exact_bytes(&mut self, buf: &mut [u8]) -> Result<(), ZByteIoError> {
        let rest = self.rest();
        match rest.get(..buf.len()) {
            Some(src) => {
                buf.copy_from_slice(src);
                self.position += buf.len();
                Ok(())
            }
            None => {
                // As `ZCursor`: what there is is copied, the position stays.
                buf[..rest.len()].copy_from_slice(rest);
                Err(ZByteIoError::NotEnoughBytes(rest.len(), buf.len()))
            }
        }
    }

    #[inline(always)]
    fn read_bytes(&mut self, buf: &mut [u8]) -> Result<usize, ZByteIoError> {
        let n = self.peek_bytes(buf)?;
        self.position += n;
        Ok(n)
    }

    #[inline(always)]
    fn peek_bytes(&mut self, buf: &mut [u8]) -> Result<usize, ZByteIoError> {
        let rest = self.rest();
        let n = rest.len().min(buf.len());
        buf[..n].copy_from_slice(&rest[..n]);
        Ok(n)
    }

    #[inline(always)]
    fn peek_exact_bytes(&mut self, buf: &mut [u8]) -> Result<(), ZByteIoError> {
        self.read_exact_bytes(buf)?;
        self.position -= buf.len();
        Ok(())
    }

    fn z_seek(&mut self, from: ZSeekFrom) -> Result<u64, ZByteIoError> {
        let (base, offset) = match from {
            ZSeekFrom::Start(n) => {
                self.position = usize::try_from(n).map_err(ZByteIoError::from)?;
                return Ok(n);
            }
            ZSeekFrom::End(n) => (self.bytes.len(), n),
            ZSeekFrom::Current(n) => (self.position, n),
        };
        let offset = isize::try_from(offset).map_err(ZByteIoError::from)?;
        self.position = base
            .checked_add_signed(offset)
            .ok_or(ZByteIoError::SeekError("Negative seek"))?;
        Ok(self.position as u64)
    }

    #[inline(always)]
    fn is_eof(&mut self) -> Result<bool, ZByteIoError> {
        Ok(self.rest().is_empty())
    }

    #[inline(always)]
    fn z_position(&mut self) -> Result<u64, ZByteIoError> {
        Ok(self.position as u64)
    }

    fn read_remaining(&mut self, sink: &mut Vec<u8>) -> Result<usize, ZByteIoError> {
        let rest = self.rest();
        sink.extend_from_slice(rest);
        self.position += rest.len();
        Ok(rest.len())
    }
}

#[cfg(test)]
mod tests {
    use zune_core::bytestream::{ZByteReaderTrait, ZCursor, ZSeekFrom};

    use super::SliceReader;

    /// Every operation the decoder uses, at the start, the middle, the end and past it: the
    /// results and positions must be `ZCursor`'s.
    fn script<R: ZByteReaderTrait>(r: &mut R) -> Vec<String> {
        let mut log = Vec::new();
        let mut note = |what: String, r: &mut R| {
            log.push(format!(
                "{what} @{:?} eof {:?}",
                r.z_position().ok(),
                r.is_eof().ok()
            ));
        };
        let mut four = [0u8; 4];
        let mut nine = [0u8; 9];
        note(format!("{}", r.read_byte_no_error()), r);
        note(
            format!("{:?} {four:?}", r.read_exact_bytes(&mut four).is_ok()),
            r,
        );
        note(
            format!("{:?} {four:?}", r.peek_exact_bytes(&mut four).is_ok()),
            r,
        );
        note(format!("{:?}", r.peek_bytes(&mut nine).ok()), r);
        note(format!("{:?}", r.read_exact_bytes(&mut nine).is_ok()), r);
        note(format!("{:?} {nine:?}", r.read_bytes(&mut nine).ok()), r);
        note(format!("{}", r.read_byte_no_error()), r);
        note(format!("{:?}", r.z_seek(ZSeekFrom::Current(-3)).ok()), r);
        note(
            format!("{:?} {four:?}", r.read_exact_bytes(&mut four).is_ok()),
            r,
        );
        note(format!("{:?}", r.z_seek(ZSeekFrom::Start(20)).ok()), r);
        note(
            format!(
                "{} {:?}",
                r.read_byte_no_error(),
                r.read_bytes(&mut four).ok()
            ),
            r,
        );
        note(format!("{:?}", r.z_seek(ZSeekFrom::End(-2)).ok()), r);
        note(
            format!("{:?}", r.z_seek(ZSeekFrom::Current(-100)).is_ok()),
            r,
        );
        let mut rest = Vec::new();
        note(
            format!("{:?} {rest:?}", r.read_remaining(&mut rest).ok()),
            r,
        );
        log
    }

    #[test]
    fn reads_like_zcursor() {
        let bytes: Vec<u8> = (1..=12).collect();
        let expected = script(&mut ZCursor::new(&bytes[..]));
        assert_eq!(script(&mut SliceReader::new(&bytes)), expected);
    }
}
