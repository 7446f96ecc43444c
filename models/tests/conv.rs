//! Our conv op (forward, input, weight and bias gradients) against Burn's own conv and against
//! PyTorch (fixtures from `fixtures/make_conv_fixtures.py`).

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::Backend;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{Distribution, Tensor, TensorData};
use models::conv::conv2d_with;
use safetensors::SafeTensors;

type TestBackend = Flex;
type Ad = Autodiff<TestBackend>;

/// Relative tolerance of every comparison (f32 sums of up to a few hundred terms).
const RTOL: f32 = 1e-4;

/// One conv case: shapes and options.
#[derive(Debug, Clone, Copy)]
struct Case {
    batch: usize,
    c_in: usize,
    c_out: usize,
    size: [usize; 2],
    kernel: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
    bias: bool,
}

impl Case {
    fn options(&self) -> ConvOptions<2> {
        ConvOptions::new([self.stride; 2], [self.padding; 2], [self.dilation; 2], 1)
    }
}

/// Forward output and the gradients of `sum(y · dy)`: `(y, dx, dweight, dbias)`.
type Results = (Vec<f32>, Vec<f32>, Vec<f32>, Option<Vec<f32>>);

fn values<const D: usize>(t: Tensor<TestBackend, D>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().expect("f32 tensor")
}

/// Runs a conv on `Autodiff<Flex>`, ours (`fast`) or Burn's.
fn run(
    fast: bool,
    options: ConvOptions<2>,
    x: &Tensor<TestBackend, 4>,
    weight: &Tensor<TestBackend, 4>,
    bias: Option<&Tensor<TestBackend, 1>>,
    dy: &Tensor<TestBackend, 4>,
) -> Results {
    let x = Tensor::<Ad, 4>::from_inner(x.clone()).require_grad();
    let weight = Tensor::<Ad, 4>::from_inner(weight.clone()).require_grad();
    let bias = bias.map(|b| Tensor::<Ad, 1>::from_inner(b.clone()).require_grad());
    let y = if fast {
        conv2d_with(x.clone(), weight.clone(), bias.clone(), options)
    } else {
        burn::tensor::module::conv2d(x.clone(), weight.clone(), bias.clone(), options)
    };
    let loss = (y.clone() * Tensor::from_inner(dy.clone())).sum();
    let grads = loss.backward();
    (
        values(y.inner()),
        values(x.grad(&grads).expect("x grad")),
        values(weight.grad(&grads).expect("weight grad")),
        bias.map(|b| values(b.grad(&grads).expect("bias grad"))),
    )
}

/// Panics with the worst element when `got` and `want` differ beyond `RTOL` relative to the
/// largest magnitude of `want`.
fn assert_close(what: &str, case: &Case, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what} of {case:?}: lengths differ");
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    let (i, err) = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .enumerate()
        .fold(
            (0, 0.0f32),
            |best, (i, e)| if e > best.1 { (i, e) } else { best },
        );
    assert!(
        err <= RTOL * scale,
        "{what} of {case:?}: element {i} is {} but the reference says {} (|diff| {err}, scale {scale})",
        got[i],
        want[i]
    );
}

fn assert_results(case: &Case, got: &Results, want: &Results) {
    assert_close("forward", case, &got.0, &want.0);
    assert_close("input gradient", case, &got.1, &want.1);
    assert_close("weight gradient", case, &got.2, &want.2);
    match (&got.3, &want.3) {
        (Some(g), Some(w)) => assert_close("bias gradient", case, g, w),
        (None, None) => {}
        _ => panic!("bias gradient of {case:?}: present on one side only"),
    }
}

fn cases() -> Vec<Case> {
    let c = |batch, c_in, c_out, size, kernel, stride, padding, bias| Case {
        batch,
        c_in,
        c_out,
        size,
        kernel,
        stride,
        padding,
        dilation: 1,
        bias,
    };
    vec![
        c(2, 3, 8, [9, 9], 3, 1, 1, true),
        c(3, 5, 4, [11, 7], 3, 2, 1, false),
        c(1, 16, 8, [6, 6], 1, 1, 0, false),
        c(4, 8, 16, [7, 9], 1, 2, 0, true),
        c(2, 3, 16, [23, 19], 7, 2, 3, false),
        c(1, 3, 4, [8, 8], 7, 1, 3, true),
        c(5, 8, 8, [3, 3], 3, 1, 1, false),
        c(33, 4, 6, [1, 1], 1, 1, 0, true),
        c(17, 16, 32, [4, 4], 3, 2, 1, false),
        Case {
            dilation: 2,
            ..c(2, 4, 4, [10, 10], 3, 1, 2, true)
        },
        // Output rows of 16 pixels and more take the row-by-row im2col/col2im; narrower ones the
        // per-pixel table. Each option again on that path:
        c(2, 3, 5, [40, 37], 7, 2, 3, false),
        c(1, 4, 6, [33, 33], 1, 2, 0, true),
        c(2, 3, 4, [17, 18], 3, 1, 1, true),
        Case {
            dilation: 2,
            ..c(1, 3, 4, [21, 20], 3, 1, 2, false)
        },
        // Taps that read only padding are dropped before the GEMMs: only the centre of a 3×3
        // over one pixel (a pointwise conv then), one axis alone, a 5×5 strided to one tap, a
        // dilated kernel, and live taps with a dead one between them (stride 2 over one pixel).
        c(3, 8, 6, [1, 1], 3, 1, 1, true),
        c(2, 4, 5, [1, 6], 3, 1, 1, false),
        c(2, 3, 4, [1, 1], 5, 2, 2, false),
        Case {
            dilation: 2,
            ..c(2, 3, 4, [2, 2], 3, 1, 2, true)
        },
        c(2, 3, 4, [1, 1], 5, 2, 3, true),
        // Fewer columns (images × pixels) than output channels: the weight gradient is not
        // computed transposed. With every tap live, pointwise and 3×3, and with dead taps above.
        c(1, 4, 16, [3, 3], 1, 1, 0, true),
        c(2, 3, 16, [2, 2], 3, 1, 1, false),
        // Stride-1 3×3 convs with 16 channels and more, and 128 tiles of 2×2 output pixels per
        // image, take Winograd's F(2×2, 3×3) where the CPU has AVX-512: each padding, odd
        // sizes, rows of 8 tiles and more (read by rows) and fewer (gathered).
        c(2, 16, 16, [24, 23], 3, 1, 1, true),
        c(1, 16, 24, [27, 26], 3, 1, 0, false),
        c(2, 24, 16, [22, 21], 3, 1, 2, true),
        c(1, 16, 16, [90, 11], 3, 1, 1, false),
    ]
}

/// Random x, weight, bias and dy for `case`; our op and Burn's must agree on all four results.
fn check_against_burn(case: &Case, device: &burn::tensor::Device<TestBackend>) {
    let [h, w] = case.size;
    let normal = Distribution::Normal(0.0, 1.0);
    let x = Tensor::random([case.batch, case.c_in, h, w], normal, device);
    let weight = Tensor::random(
        [case.c_out, case.c_in, case.kernel, case.kernel],
        normal,
        device,
    );
    let bias = case
        .bias
        .then(|| Tensor::random([case.c_out], normal, device));
    let y_dims =
        burn::tensor::module::conv2d(x.clone(), weight.clone(), bias.clone(), case.options())
            .dims();
    let dy = Tensor::random(y_dims, normal, device);
    let ours = run(true, case.options(), &x, &weight, bias.as_ref(), &dy);
    let burns = run(false, case.options(), &x, &weight, bias.as_ref(), &dy);
    assert_results(case, &ours, &burns);
}

#[test]
fn matches_burns_conv_forward_and_gradients() {
    let device = Default::default();
    TestBackend::seed(&device, 42);
    for case in cases() {
        check_against_burn(&case, &device);
    }
}

/// A batch large enough to be split into several chunks and parallel groups, at ResNet's last
/// stage at 32 px (2×2 → 1×1 strided, then 1×1 → 1×1) and at 56×56.
#[test]
fn chunked_batches_match_burns_conv() {
    let device = Default::default();
    TestBackend::seed(&device, 7);
    for case in [
        Case {
            batch: 64,
            c_in: 32,
            c_out: 16,
            size: [2, 2],
            kernel: 3,
            stride: 2,
            padding: 1,
            dilation: 1,
            bias: false,
        },
        Case {
            batch: 64,
            c_in: 32,
            c_out: 16,
            size: [1, 1],
            kernel: 3,
            stride: 1,
            padding: 1,
            dilation: 1,
            bias: true,
        },
        Case {
            batch: 3,
            c_in: 8,
            c_out: 8,
            size: [56, 56],
            kernel: 3,
            stride: 1,
            padding: 1,
            dilation: 1,
            bias: true,
        },
    ] {
        check_against_burn(&case, &device);
    }
}

/// Our op against PyTorch's `conv2d` and autograd.
#[test]
fn matches_torch_fixtures() {
    let bytes = include_bytes!("fixtures/conv_torch.safetensors");
    let file = SafeTensors::deserialize(bytes).expect("fixture is valid safetensors");
    let device = Default::default();
    let f32s = |name: &str| -> Option<(Vec<f32>, Vec<usize>)> {
        let view = file.tensor(name).ok()?;
        let data = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Some((data, view.shape().to_vec()))
    };
    let tensor = |name: &str| -> Option<(Vec<f32>, Vec<usize>)> { f32s(name) };
    let mut checked = 0;
    for i in 0.. {
        let Ok(config) = file.tensor(&format!("case{i}.config")) else {
            break;
        };
        let c: Vec<usize> = config
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
            .collect();
        let case = Case {
            batch: c[0],
            c_in: c[1],
            c_out: c[2],
            size: [c[3], c[4]],
            kernel: c[5],
            stride: c[6],
            padding: c[7],
            dilation: c[8],
            bias: c[9] == 1,
        };
        let load4 = |name: &str| -> Tensor<TestBackend, 4> {
            let (data, shape) = tensor(&format!("case{i}.{name}")).expect("fixture tensor");
            Tensor::from_data(TensorData::new(data, shape), &device)
        };
        let x = load4("x");
        let weight = load4("weight");
        let dy = load4("dy");
        let bias = case.bias.then(|| {
            let (data, shape) = tensor(&format!("case{i}.bias")).expect("bias");
            Tensor::<TestBackend, 1>::from_data(TensorData::new(data, shape), &device)
        });
        let want: Results = (
            tensor(&format!("case{i}.y")).expect("y").0,
            tensor(&format!("case{i}.dx")).expect("dx").0,
            tensor(&format!("case{i}.dweight")).expect("dweight").0,
            case.bias
                .then(|| tensor(&format!("case{i}.dbias")).expect("dbias").0),
        );
        let ours = run(true, case.options(), &x, &weight, bias.as_ref(), &dy);
        assert_results(&case, &ours, &want);
        checked += 1;
    }
    assert_eq!(checked, 6, "the fixture holds six cases");
}

/// `models::nn::Conv2d` is a drop-in for `burn::nn::conv::Conv2d`: same config API, and a Burn
/// module's record loads into ours and computes the same output.
#[test]
fn conv2d_module_is_a_drop_in_for_burns() {
    use burn::module::Module;
    use burn::nn::PaddingConfig2d;
    use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};

    let device = Default::default();
    TestBackend::seed(&device, 3);
    let burns = burn::nn::conv::Conv2dConfig::new([3, 5], [3, 3])
        .with_stride([2, 2])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .init::<TestBackend>(&device);
    let ours = models::nn::Conv2dConfig::new([3, 5], [3, 3])
        .with_stride([2, 2])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .init::<TestBackend>(&device);
    let x = Tensor::random([2, 3, 9, 9], Distribution::Normal(0.0, 1.0), &device);
    // Burn's params initialise lazily: run it before taking its record, so both hold the values
    // that the reference output used.
    let want = values(burns.forward(x.clone()));
    let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::new();
    let bytes = recorder
        .record(burns.into_record(), ())
        .expect("Burn's record serialises");
    let record = recorder
        .load(bytes, &device)
        .expect("Burn's Conv2d record loads as ours (same field names)");
    let ours = ours.load_record(record);
    let case = Case {
        batch: 2,
        c_in: 3,
        c_out: 5,
        size: [9, 9],
        kernel: 3,
        stride: 2,
        padding: 1,
        dilation: 1,
        bias: true,
    };
    assert_close("module forward", &case, &values(ours.forward(x)), &want);
}
