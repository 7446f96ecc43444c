//! Kernel taps that read only padding, dropped before the GEMMs.
//!
//! A 3×3 convolution with padding 1 over a 1×1 input reads zeros at 8 of its 9 taps for every
//! output pixel; over the whole of ResNet's last stage at 32 px, 7/8 of the multiply-adds meet
//! padding. im2col writes those zeros and the GEMMs multiply them, in all three passes. A tap
//! that reads padding for *every* output pixel contributes nothing to the output, receives
//! nothing in the input gradient, and has a zero weight gradient, so the convolution over the
//! remaining taps (a smaller kernel with less padding) gives the same results with a K that is
//! smaller by the same factor. The 1×1 case becomes a pointwise conv, whose column matrix is the
//! input itself.

use std::ops::Range;

use super::cpu::Geometry;

/// The rectangle of kernel taps `[rows, cols]` that reach the input for at least one output
/// pixel. Taps inside it may still read only padding (possible with a stride larger than the
/// input); im2col writes their zeros as before.
pub(crate) type LiveTaps = [Range<usize>; 2];

/// The live taps along one axis: `t` is live when some output position `o` reads input
/// `o·stride + t·dilation − padding` inside `0..size`.
fn live_along(g: &Geometry, axis: usize) -> Range<usize> {
    let size = g.input_extent(axis) as isize;
    let live = |t: usize| {
        (0..g.out[axis]).any(|o| {
            let i = (o * g.stride[axis] + t * g.dilation[axis]) as isize - g.padding[axis] as isize;
            (0..size).contains(&i)
        })
    };
    let k = g.kernel[axis];
    let lo = (0..k).find(|&t| live(t)).unwrap_or(k);
    let hi = (lo..k).rev().find(|&t| live(t)).map_or(lo, |t| t + 1);
    lo..hi
}

/// The same convolution over its live taps only, with the padding before the first live tap
/// removed; `None` when every tap is live (nothing to drop), none is (the output is the bias
/// alone: the general path handles it), or dropping would need a negative padding.
///
/// The output size stays `g.out`: the kernels never derive it from the padding, and the padding
/// after the last live tap only ever appears as a bounds check.
pub(crate) fn without_dead_taps(g: &Geometry) -> Option<(Geometry, LiveTaps)> {
    let live = [live_along(g, 0), live_along(g, 1)];
    if live.iter().any(|r| r.is_empty())
        || (live[0].len(), live[1].len()) == (g.kernel[0], g.kernel[1])
    {
        return None;
    }
    let pad = |axis: usize| g.padding[axis].checked_sub(live[axis].start * g.dilation[axis]);
    let reduced = Geometry {
        kernel: [live[0].len(), live[1].len()],
        padding: [pad(0)?, pad(1)?],
        ..*g
    };
    Some((reduced, live))
}

/// The offsets of the live taps inside one `kh×kw` filter, row-major.
fn tap_offsets(g: &Geometry, live: &LiveTaps) -> Vec<usize> {
    live[0]
        .clone()
        .flat_map(|ki| live[1].clone().map(move |kj| ki * g.kernel[1] + kj))
        .collect()
}

/// `weight[Co, Ci, kh, kw]` restricted to the live taps: `[Co, Ci, rows, cols]`.
///
/// A gather through the tap offsets rather than row copies: a live row is often one or two
/// floats, and a `memcpy` call per float cost more than the copy.
pub(crate) fn live_weight(g: &Geometry, weight: &[f32], live: &LiveTaps) -> Vec<f32> {
    let taps = tap_offsets(g, live);
    let filters = weight
        .chunks_exact(g.kernel[0] * g.kernel[1])
        .take(g.c_out * g.c_in);
    let mut out = Vec::with_capacity(g.c_out * g.c_in * taps.len());
    for filter in filters {
        out.extend(taps.iter().map(|&t| filter[t]));
    }
    out
}

/// For each row of the live column matrix (`Ci × live taps`), its row in the full one
/// (`Ci·kh·kw`): where the weight gradient of the live convolution goes in the full gradient,
/// whose other (dead) taps are zero.
pub(crate) fn full_rows(g: &Geometry, live: &LiveTaps) -> Vec<usize> {
    let taps = tap_offsets(g, live);
    let per_channel = g.kernel[0] * g.kernel[1];
    (0..g.c_in)
        .flat_map(|c| taps.iter().map(move |&t| c * per_channel + t))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(
        size: [usize; 2],
        kernel: usize,
        stride: usize,
        padding: usize,
        dilation: usize,
    ) -> Geometry {
        Geometry::new(
            [2, 3, size[0], size[1]],
            [4, 3, kernel, kernel],
            [stride; 2],
            [padding; 2],
            [dilation; 2],
        )
        .expect("a non-empty output")
    }

    #[test]
    fn a_3x3_conv_over_one_pixel_keeps_only_its_centre_and_becomes_pointwise() {
        let g = geometry([1, 1], 3, 1, 1, 1);
        let (reduced, live) = without_dead_taps(&g).expect("8 dead taps");
        assert_eq!(live, [1..2, 1..2]);
        assert_eq!(reduced.kernel, [1, 1]);
        assert_eq!(reduced.padding, [0, 0]);
        assert_eq!(reduced.out, [1, 1]);
    }

    #[test]
    fn a_strided_3x3_conv_from_2x2_to_1x1_keeps_the_four_taps_it_reaches() {
        let g = geometry([2, 2], 3, 2, 1, 1);
        let (reduced, live) = without_dead_taps(&g).expect("5 dead taps");
        assert_eq!(live, [1..3, 1..3]);
        assert_eq!((reduced.kernel, reduced.padding), ([2, 2], [0, 0]));
    }

    #[test]
    fn one_axis_may_shrink_alone_and_keep_its_padding_on_the_other() {
        let g = geometry([1, 6], 3, 1, 1, 1);
        let (reduced, live) = without_dead_taps(&g).expect("the top and bottom rows are dead");
        assert_eq!(live, [1..2, 0..3]);
        assert_eq!((reduced.kernel, reduced.padding), ([1, 3], [0, 1]));
    }

    #[test]
    fn nothing_is_dropped_where_every_tap_reaches_the_input() {
        for g in [
            geometry([2, 2], 3, 1, 1, 1),
            geometry([8, 8], 3, 1, 1, 1),
            geometry([7, 7], 7, 2, 3, 1),
            geometry([4, 4], 1, 2, 0, 1),
        ] {
            assert!(without_dead_taps(&g).is_none(), "{g:?}");
        }
    }

    #[test]
    fn dilation_counts_in_the_reach_of_a_tap() {
        let g = geometry([2, 2], 3, 1, 2, 2);
        let (reduced, live) = without_dead_taps(&g).expect("only the centre reaches");
        assert_eq!(live, [1..2, 1..2]);
        assert_eq!((reduced.kernel, reduced.padding), ([1, 1], [0, 0]));
    }

    #[test]
    fn the_live_weight_and_its_rows_in_the_full_kernel_agree() {
        let g = geometry([2, 2], 3, 2, 1, 1);
        let (_, live) = without_dead_taps(&g).expect("dead taps");
        let weight: Vec<f32> = (0..4 * 3 * 9).map(|i| i as f32).collect();
        let kept = live_weight(&g, &weight, &live);
        assert_eq!(kept.len(), 4 * 3 * 4);
        // Filter 0's taps (1,1), (1,2), (2,1), (2,2) of its 3×3: offsets 4, 5, 7, 8.
        assert_eq!(&kept[..4], &[4.0, 5.0, 7.0, 8.0]);
        let rows = full_rows(&g, &live);
        assert_eq!(&rows[..8], &[4, 5, 7, 8, 13, 14, 16, 17]);
        // Row r of the live kernel is row rows[r] of the full one, for every filter.
        for (i, &w) in kept.iter().enumerate() {
            let (filter, r) = (i / rows.len(), i % rows.len());
            assert_eq!(w, weight[filter * 3 * 9 + rows[r]], "element {i}");
        }
    }
}
