//! DCT-domain downscaling: decoding at 1/2, 1/4 or 1/8 of the image's size, as libjpeg's
//! `scale_num`/`scale_denom`. Not in upstream zune-jpeg; see `JpegDecoder::set_scale`.
//!
//! Each block's `N × N` output is its 8-point inverse DCT averaged over `8/N × 8/N` pixels,
//! computed in the DCT domain without the full-size output (see [`basis`]), so a block at 1/8
//! is its DC alone and its AC coefficients are skipped unread.
//!
//! A subsampled component is transformed to a larger block so that every component comes out
//! at the scaled image's resolution, as libjpeg-turbo does: at 1/2, a 4:2:0 image's luma gives
//! 4 × 4 pixels per block and its chroma 8 × 8. No upsampling is needed, so the decode is
//! an entropy decode, a small transform and a colour conversion per row.

use alloc::vec;
use alloc::vec::Vec;

use zune_core::bytestream::ZByteReaderTrait;
use zune_core::colorspace::ColorSpace;
use zune_core::log::error;

use crate::bitstream::BitStream;
use crate::decoder::MAX_COMPONENTS;
use crate::errors::DecodeErrors;
use crate::mcu::{McuContinuation, DCT_BLOCK};
use crate::misc::setup_component_params;
use crate::worker::color_convert;
use crate::JpegDecoder;

/// The scales (`1/denominator`) the decoder can produce.
pub(crate) const SCALES: [usize; 4] = [1, 2, 4, 8];

impl<T: ZByteReaderTrait> JpegDecoder<T> {
    /// The denominator the decode will use: the one [`JpegDecoder::set_scale`] asked for when
    /// this image allows it, else 1. Needs the headers.
    pub(crate) fn effective_scale(&self) -> usize {
        let s = self.scale;
        if s == 1 || !self.headers_decoded || self.is_progressive || self.is_mjpeg {
            return 1;
        }
        // Three components, all in the first scan, converted to RGB-like output: nearly every
        // camera and ImageNet JPEG. Everything else decodes at full size.
        if self.input_colorspace != ColorSpace::YCbCr
            || self.components.len() != 3
            || usize::from(self.num_scans) != 3
            || !matches!(
                self.options.jpeg_get_out_colorspace(),
                ColorSpace::RGB | ColorSpace::RGBA | ColorSpace::BGR | ColorSpace::BGRA
            )
        {
            return 1;
        }
        let h_max = self.components.iter().map(|c| c.horizontal_sample).max().unwrap_or(0);
        let v_max = self.components.iter().map(|c| c.vertical_sample).max().unwrap_or(0);
        // Each component's block must come out as 1, 2, 4 or 8 pixels a side.
        let fits = |max: usize, own: usize| {
            own != 0 && max % own == 0 && (max / own).is_power_of_two() && max / own <= s
        };
        let ok = self.components.iter().all(|c| {
            fits(h_max, c.horizontal_sample) && fits(v_max, c.vertical_sample)
        });
        if ok {
            s
        } else {
            1
        }
    }

    /// The output's width and height at [`Self::effective_scale`].
    pub(crate) fn scaled_size(&self) -> (usize, usize) {
        let s = self.effective_scale();
        (
            usize::from(self.info.width).div_ceil(s),
            usize::from(self.info.height).div_ceil(s)
        )
    }

    /// Decodes a baseline image at `1/s` of its size into `pixels` (the scaled image, rows of
    /// `scaled_size().0` pixels). With a region (in the scaled image's pixels), blocks outside
    /// it are skipped as in the full-size decode and decoding stops after its last row.
    pub(crate) fn decode_scaled(&mut self, pixels: &mut [u8], s: usize) -> Result<(), DecodeErrors> {
        setup_component_params(self)?;
        self.check_tables()?;

        let (out_w, out_h) = self.scaled_size();
        let out_components = self.options.jpeg_get_out_colorspace().num_components();
        let (h_max, v_max) = (self.h_max, self.v_max);
        let (mcu_x, mcu_y) = (self.mcu_x, self.mcu_y);
        // One MCU in output pixels, and the padded width of a row of MCUs.
        let (mcu_w, mcu_h) = (8 * h_max / s, 8 * v_max / s);
        let padded_w = mcu_x * mcu_w;

        // Per component: its block's output width and height.
        let mut blocks = [(0usize, 0usize); MAX_COMPONENTS];
        for (b, c) in blocks.iter_mut().zip(&self.components) {
            *b = (mcu_w / c.horizontal_sample, mcu_h / c.vertical_sample);
        }
        let mut planes: [Vec<i16>; 3] = core::array::from_fn(|_| vec![0; padded_w * mcu_h]);

        // The region, in MCUs of the scaled image.
        let (x0, y0, x1, y1) = match self.region {
            Some((x0, y0, x1, y1)) if x0 < x1.min(out_w) && y0 < y1.min(out_h) => {
                (x0, y0, x1.min(out_w), y1.min(out_h))
            }
            _ => (0, 0, out_w, out_h)
        };
        let cols = x0 / mcu_w..=(x1 - 1) / mcu_w;
        let rows = y0 / mcu_h..=(y1 - 1) / mcu_h;

        let bases = Bases::new();
        let mut stream = BitStream::new();
        let mut tmp = [0_i32; DCT_BLOCK];
        let scan = self.z_order;
        let row_bytes = out_w * out_components;

        for i in 0..mcu_y {
            if stream.overread_by > 0 {
                if self.options.strict_mode() {
                    return Err(DecodeErrors::FormatStatic("Premature end of buffer"));
                }
                error!("Premature end of buffer");
                fill_from(pixels, i * mcu_h * row_bytes);
                return Ok(());
            }
            let row_in_region = rows.contains(&i);
            for j in 0..mcu_x {
                let transform = row_in_region && cols.contains(&j);
                for &k in &scan[..3] {
                    let component = &mut self.components[k];
                    let dc_table = self.dc_huffman_tables[component.dc_huff_table % MAX_COMPONENTS]
                        .as_ref()
                        .ok_or_else(|| DecodeErrors::FormatStatic("DC table not found"))?;
                    let ac_table = self.ac_huffman_tables[component.ac_huff_table % MAX_COMPONENTS]
                        .as_ref()
                        .ok_or_else(|| DecodeErrors::FormatStatic("AC table not found"))?;
                    let (bw, bh) = blocks[k];
                    for v in 0..component.vertical_sample {
                        for h in 0..component.horizontal_sample {
                            let result = if !transform {
                                stream.skip_mcu_block(
                                    &mut self.stream,
                                    dc_table,
                                    ac_table,
                                    &mut component.dc_pred
                                )
                            } else if bw == 1 && bh == 1 {
                                // The block's mean is its DC alone.
                                stream
                                    .skip_mcu_block(
                                        &mut self.stream,
                                        dc_table,
                                        ac_table,
                                        &mut component.dc_pred
                                    )
                                    .map(|_| {
                                        tmp[0] = component.dc_pred
                                            * component.quantization_table[0];
                                        1
                                    })
                            } else {
                                tmp.fill(0);
                                stream.decode_mcu_block(
                                    &mut self.stream,
                                    dc_table,
                                    ac_table,
                                    &component.quantization_table,
                                    &mut tmp,
                                    &mut component.dc_pred
                                )
                            };
                            if let Err(e) = result {
                                if self.options.strict_mode() {
                                    return Err(e);
                                }
                                error!("{}", e);
                                fill_from(pixels, i * mcu_h * row_bytes);
                                return Ok(());
                            }
                            if transform {
                                let at = v * bh * padded_w + (j * component.horizontal_sample + h) * bw;
                                let out = &mut planes[k][at..];
                                if bw == 8 && bh == 8 {
                                    (self.idct_func)(&mut tmp, out, padded_w);
                                } else {
                                    idct_scaled(&bases, &tmp, bw, bh, out, padded_w);
                                }
                            }
                        }
                    }
                }
                self.todo = self.todo.wrapping_sub(1);
                if self.todo == 0 {
                    self.handle_rst_main(&mut stream)?;
                    continue;
                }
                if stream.marker.is_some() && stream.bits_left == 0 {
                    break;
                }
            }
            let next = self.check_stream_marker_after_mcu_width(&mut stream)?;

            if row_in_region {
                let first = i * mcu_h;
                for r in 0..mcu_h.min(out_h - first) {
                    let line = first + r;
                    if line < y0 || line >= y1 {
                        continue;
                    }
                    let samples: [&[i16]; MAX_COMPONENTS] = [
                        &planes[0][r * padded_w..(r + 1) * padded_w],
                        &planes[1][r * padded_w..(r + 1) * padded_w],
                        &planes[2][r * padded_w..(r + 1) * padded_w],
                        &[]
                    ];
                    color_convert(
                        &samples,
                        self.color_convert_16,
                        self.input_colorspace,
                        self.options.jpeg_get_out_colorspace(),
                        &mut pixels[line * row_bytes..(line + 1) * row_bytes],
                        out_w,
                        padded_w
                    )?;
                }
                if i == *rows.end() {
                    return Ok(());
                }
            }
            match next {
                McuContinuation::Ok => {}
                // A second scan, a setup marker or a corrupt stream: the image is as far as
                // it got, the rest grey as in the full-size decode.
                _ => {
                    fill_from(pixels, (i + 1) * mcu_h * row_bytes);
                    return Ok(());
                }
            }
        }
        Ok(())
    }
}

/// Fills `pixels` from byte `start` on with mid-grey, as the full-size decode does for the part
/// of a truncated image it could not decode.
fn fill_from(pixels: &mut [u8], start: usize) {
    if let Some(rest) = pixels.get_mut(start..) {
        rest.fill(128);
    }
}

/// `COS16[x][k] = cos((2x + 1) k π / 16)`.
const COS16: [[f32; 8]; 8] = [
    [1.000000000, 0.980785280, 0.923879533, 0.831469612, 0.707106781, 0.555570233, 0.382683432, 0.195090322],
    [1.000000000, 0.831469612, 0.382683432, -0.195090322, -0.707106781, -0.980785280, -0.923879533, -0.555570233],
    [1.000000000, 0.555570233, -0.382683432, -0.980785280, -0.707106781, 0.195090322, 0.923879533, 0.831469612],
    [1.000000000, 0.195090322, -0.923879533, -0.555570233, 0.707106781, 0.831469612, -0.382683432, -0.980785280],
    [1.000000000, -0.195090322, -0.923879533, 0.555570233, 0.707106781, -0.831469612, -0.382683432, 0.980785280],
    [1.000000000, -0.555570233, -0.382683432, 0.980785280, -0.707106781, -0.195090322, 0.923879533, -0.831469612],
    [1.000000000, -0.831469612, 0.382683432, 0.195090322, -0.707106781, 0.980785280, -0.923879533, 0.555570233],
    [1.000000000, -0.980785280, 0.923879533, -0.831469612, 0.707106781, -0.555570233, 0.382683432, -0.195090322],
];

/// The rows of the inverse DCT that give a block's `n × n` output at `1/s` of its size
/// (`n = 8 / s`): `basis[x][u] = c(u) / 2 · mean over i < s of COS16[s·x + i][u]`, with
/// `c(0) = 1/√2` and 1 otherwise. Two passes give the 8-point transform's output averaged over
/// `s × s` pixels, exactly (libjpeg-turbo's reduced transforms do the same for 1/2 to 1/8):
/// the scaled image is the full decode's area average, not a sharper band-limited one. At
/// `n = 8` this is the plain 8-point basis; at `n = 1` only the DC term is left.
fn basis(n: usize) -> [[f32; 8]; 8] {
    let s = 8 / n;
    let mut t = [[0.0f32; 8]; 8];
    for (x, row) in t.iter_mut().enumerate().take(n) {
        for (u, v) in row.iter_mut().enumerate() {
            let c = if u == 0 { core::f32::consts::FRAC_1_SQRT_2 } else { 1.0 };
            let mean = (0..s).map(|i| COS16[s * x + i][u]).sum::<f32>() / s as f32;
            *v = c / 2.0 * mean;
        }
    }
    t
}

/// The bases for `n` = 1, 2, 4, 8, indexed by `log2(n)`.
pub(crate) struct Bases([[[f32; 8]; 8]; 4]);

impl Bases {
    fn new() -> Self {
        Bases([basis(1), basis(2), basis(4), basis(8)])
    }

    fn get(&self, n: usize) -> &[[f32; 8]; 8] {
        &self.0[n.trailing_zeros() as usize & 3]
    }
}

/// The `bw × bh` output of a block at `8 / bw` by `8 / bh` of its size from its `coefficients`
/// (dequantised, natural order), level-shifted and clamped to 0..=255, into `out` at `stride`.
fn idct_scaled(
    bases: &Bases, coefficients: &[i32; 64], bw: usize, bh: usize, out: &mut [i16], stride: usize
) {
    let (cw, ch) = (bases.get(bw), bases.get(bh));
    // Horizontal pass, over the rows of coefficients that hold anything (few in a photo).
    let mut rows = [[0.0f32; 8]; 8];
    let mut used = [false; 8];
    for v in 0..8 {
        let f = &coefficients[v * 8..v * 8 + 8];
        if f.iter().all(|&c| c == 0) {
            continue;
        }
        used[v] = true;
        let f: [f32; 8] = core::array::from_fn(|u| f[u] as f32);
        for (x, r) in rows[v].iter_mut().enumerate().take(bw) {
            *r = (0..8).map(|u| cw[x][u] * f[u]).sum();
        }
    }
    for y in 0..bh {
        let line = &mut out[y * stride..y * stride + bw];
        for (x, px) in line.iter_mut().enumerate() {
            let value: f32 = (0..8).filter(|&v| used[v]).map(|v| ch[y][v] * rows[v][x]).sum();
            // Rounds half up (without `f32::round`, which `core` lacks): the cast truncates
            // towards zero, and anything negative clamps to 0 either way.
            *px = ((value + 128.5) as i32).clamp(0, 255) as i16;
        }
    }
}
