//! Every pass against a direct convolution, the AVX-512 transforms against the scalar
//! reference to the bit, and which convolutions take Winograd.

use super::*;

/// A direct convolution, the definition written out: the reference for every pass.
fn direct(g: &Geometry, x: &[f32], w: &[f32]) -> Vec<f32> {
    let [oh, ow] = g.out;
    let mut y = vec![0.0f32; g.batch * g.c_out * oh * ow];
    for n in 0..g.batch {
        for o in 0..g.c_out {
            for r in 0..oh {
                for c in 0..ow {
                    let mut sum = 0.0f64;
                    for i in 0..g.c_in {
                        for a in 0..3 {
                            for b in 0..3 {
                                let (xr, xc) = (r + a, c + b);
                                let (Some(xr), Some(xc)) =
                                    (xr.checked_sub(g.padding[0]), xc.checked_sub(g.padding[1]))
                                else {
                                    continue;
                                };
                                if xr >= g.height || xc >= g.width {
                                    continue;
                                }
                                let xv = x[((n * g.c_in + i) * g.height + xr) * g.width + xc];
                                sum += f64::from(xv * w[((o * g.c_in + i) * 3 + a) * 3 + b]);
                            }
                        }
                    }
                    y[((n * g.c_out + o) * oh + r) * ow + c] = sum as f32;
                }
            }
        }
    }
    y
}

/// `Σ y · dy` of the direct conv, differentiated one variable at a time through linearity:
/// dx[j] = Σ_y dy · ∂y/∂x[j], obtained by convolving unit inputs.
fn direct_grads(g: &Geometry, x: &[f32], w: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let dot = |y: &[f32]| y.iter().zip(dy).map(|(a, b)| f64::from(a * b)).sum::<f64>() as f32;
    let mut unit = vec![0.0f32; x.len()];
    let dx = (0..x.len())
        .map(|j| {
            unit[j] = 1.0;
            let v = dot(&direct(g, &unit, w));
            unit[j] = 0.0;
            v
        })
        .collect();
    let mut unit = vec![0.0f32; w.len()];
    let dw = (0..w.len())
        .map(|j| {
            unit[j] = 1.0;
            let v = dot(&direct(g, x, &unit));
            unit[j] = 0.0;
            v
        })
        .collect();
    (dx, dw)
}

/// Deterministic values in [−1, 1).
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// A stride-1 3×3 conv of `input` (`[N, Ci, H, W]`) to `c_out` channels, with its input,
/// weight, bias and output gradient drawn from seeds `seed` to `seed + 3`.
struct Case {
    g: Geometry,
    x: Vec<f32>,
    w: Vec<f32>,
    bias: Vec<f32>,
    dy: Vec<f32>,
}

impl Case {
    fn new(input: [usize; 4], c_out: usize, padding: [usize; 2], seed: u64) -> Self {
        let c_in = input[1];
        let g = Geometry::new(input, [c_out, c_in, 3, 3], [1, 1], padding, [1, 1])
            .expect("a valid conv");
        Self {
            x: values(input.iter().product(), seed),
            w: values(c_out * c_in * 9, seed + 1),
            bias: values(c_out, seed + 2),
            dy: values(g.batch * c_out * g.pixels(), seed + 3),
            g,
        }
    }
}

fn assert_close(what: &str, g: &Geometry, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what} of {g:?}: lengths differ");
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * scale,
            "{what} of {g:?}: element {i} is {a}, the direct conv says {b} (scale {scale})"
        );
    }
}

#[test]
fn all_three_passes_match_the_direct_conv() {
    // Odd and even sizes (tiles cut by the edge), each padding, channels in and out unequal,
    // and a batch of 400 small images split into several chunks of TARGET_TILES.
    let cases = [
        ([2, 3, 7, 9], 4, [1, 1]),
        ([1, 2, 6, 6], 3, [0, 0]),
        ([3, 4, 5, 4], 2, [2, 2]),
        ([2, 3, 2, 3], 2, [1, 0]),
        ([400, 1, 4, 5], 2, [1, 1]),
    ];
    for (input, c_out, padding) in cases {
        let Case { g, x, w, bias, dy } = Case::new(input, c_out, padding, 1);
        let mut want = direct(&g, &x, &w);
        for (plane, b) in want.chunks_mut(g.pixels()).zip(bias.iter().cycle()) {
            plane.iter_mut().for_each(|v| *v += b);
        }
        for schedule in [Schedule::ByImages, Schedule::ByPoints] {
            let forward = forward_with(Kernel::best(), schedule, &g, &x, &w, Some(&bias));
            assert_close(&format!("{schedule:?} forward"), &g, &forward, &want);
        }
        if g.batch > 3 {
            continue; // The unit-vector gradients below are quadratic in the sizes.
        }
        let (dx, dw) = direct_grads(&g, &x, &w, &dy);
        for schedule in [Schedule::ByImages, Schedule::ByPoints] {
            let what = |pass: &str| format!("{schedule:?} {pass}");
            let input_grad = input_grad_with(Kernel::best(), schedule, &g, &w, &dy);
            assert_close(&what("input gradient"), &g, &input_grad, &dx);
            let weight_grad = weight_grad_with(Kernel::best(), schedule, &g, &x, &dy);
            assert_close(&what("weight gradient"), &g, &weight_grad, &dw);
        }
    }
}

/// The AVX-512 transforms against the scalar reference, to the bit: by gathers (narrow
/// planes) and by rows (from ROW_TILES tiles per row on), every padding, odd sizes, and a
/// row of tiles that ends inside a group of 16.
#[test]
#[cfg(target_arch = "x86_64")]
fn the_vector_transforms_match_the_scalar_ones() {
    if Kernel::best() != Kernel::Avx512 {
        eprintln!("skipped: this CPU has no AVX-512F");
        return;
    }
    let cases = [
        ([2, 3, 7, 9], 4, [1, 1]),
        ([1, 2, 20, 37], 3, [1, 1]),
        ([2, 2, 17, 40], 2, [0, 0]),
        ([1, 3, 16, 33], 2, [2, 2]),
        ([3, 2, 9, 16], 3, [1, 0]),
        ([1, 2, 34, 66], 2, [0, 1]),
        // Planes that fit a window: 8×8 and 7×7 alone, 4×4 and 3×3 by 4, 2×2 by 16
        // (the last group of 17 images with one plane), 1×2 planes by 16 (the copy).
        ([3, 2, 8, 8], 3, [1, 1]),
        ([2, 3, 7, 7], 2, [1, 1]),
        ([5, 2, 4, 4], 3, [1, 1]),
        ([3, 2, 3, 3], 2, [1, 0]),
        ([17, 2, 2, 2], 2, [1, 1]),
        ([17, 2, 1, 2], 2, [1, 1]),
    ];
    for (input, c_out, padding) in cases {
        let Case { g, x, w, bias, dy } = Case::new(input, c_out, padding, 5);
        for schedule in [Schedule::ByImages, Schedule::ByPoints] {
            let both =
                |pass: &dyn Fn(Kernel) -> Vec<f32>| (pass(Kernel::Avx512), pass(Kernel::Scalar));
            for (what, (vector, scalar)) in [
                (
                    "forward",
                    both(&|k| forward_with(k, schedule, &g, &x, &w, Some(&bias))),
                ),
                (
                    "input gradient",
                    both(&|k| input_grad_with(k, schedule, &g, &w, &dy)),
                ),
                (
                    "weight gradient",
                    both(&|k| weight_grad_with(k, schedule, &g, &x, &dy)),
                ),
            ] {
                assert_eq!(vector.len(), scalar.len());
                if let Some(i) = (0..vector.len()).find(|&i| vector[i] != scalar[i]) {
                    panic!(
                        "{schedule:?} {what} of {g:?}: element {i} is {} with AVX-512, {} \
                         without",
                        vector[i], scalar[i]
                    );
                }
            }
        }
    }
}

#[test]
fn resnet_shapes_take_it_and_others_do_not() {
    let geometry = |batch, c, size, kernel, stride| {
        Geometry::new(
            [batch, c, size, size],
            [c, c, kernel, kernel],
            [stride; 2],
            [kernel / 2; 2],
            [1, 1],
        )
        .expect("a valid conv")
    };
    let vectors = Kernel::best() != Kernel::Scalar;
    assert_eq!(applies(&geometry(8, 64, 56, 3, 1)), vectors);
    assert_eq!(applies(&geometry(1, 64, 28, 3, 1)), vectors);
    assert!(!applies(&geometry(1, 512, 7, 3, 1)), "16 tiles");
    // ResNet-50's 7×7 stage at batch 8: 128 tiles, too few for 512 channels' gradient.
    assert_eq!(applies(&geometry(8, 512, 7, 3, 1)), vectors);
    assert!(!applies_to_weight_grad(&geometry(8, 512, 7, 3, 1)));
    assert_eq!(applies_to_weight_grad(&geometry(8, 256, 14, 3, 1)), vectors);
    assert!(!applies(&geometry(8, 64, 56, 3, 2)), "stride 2");
    assert!(!applies(&geometry(8, 64, 56, 1, 1)), "1×1");
    assert!(!applies(&geometry(8, 3, 56, 3, 1)), "3 channels");
    assert!(!applies(&geometry(32, 512, 1, 3, 1)), "a 1×1 output");
}
