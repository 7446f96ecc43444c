//! [`ConvBackend`]: the conv op as a backend extension (Burn book, "Custom kernels";
//! `examples/custom-cubecl-kernel` at v0.21.0), its CPU kernels for Flex, and its autodiff.

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::ops::{ConvOptions, FloatTensor, ModuleOps};
use burn::tensor::{DType, TensorMetadata};
use burn_flex::{Flex, FlexTensor};

use super::cpu::{self, Geometry};
use crate::primitive::{contiguous, flex_f32, values};

/// A backend with its own 2-D convolution and gradients.
///
/// Every method defaults to Burn's own op, so any backend joins with an empty `impl`; Flex
/// overrides them with im2col/col2im + GEMM kernels, and `Autodiff<B>` records one node whose
/// backward calls the inner backend's [`conv2d_input_grad`](Self::conv2d_input_grad) and
/// [`conv2d_weight_grad`](Self::conv2d_weight_grad).
pub trait ConvBackend: Backend {
    /// Convolution forward.
    ///
    /// # Shapes
    /// - `x`: `[N, Ci, H, W]`, `weight`: `[Co, Ci / groups, kh, kw]`, `bias`: `[Co]`
    /// - returns `[N, Co, Ho, Wo]`
    fn conv2d_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        Self::conv2d(x, weight, bias, options)
    }

    /// Gradient of the loss with respect to `x`, given the output gradient.
    fn conv2d_input_grad(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        Self::conv2d_x_backward(x, weight, output_grad, options)
    }

    /// Gradient of the loss with respect to `weight`, given the output gradient.
    fn conv2d_weight_grad(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        Self::conv2d_weight_backward(x, weight, output_grad, options)
    }

    /// Gradient of the loss with respect to `bias`, given the output gradient.
    fn conv2d_bias_grad(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::conv2d_bias_backward(x, bias, output_grad)
    }
}

fn dims4(t: &FlexTensor) -> [usize; 4] {
    let shape = t.shape();
    [shape[0], shape[1], shape[2], shape[3]]
}

/// The geometry when our kernels handle the case (f32, groups 1), else `None` (Burn's op).
fn flex_geometry(
    x: &FlexTensor,
    weight: &FlexTensor,
    options: &ConvOptions<2>,
) -> Option<Geometry> {
    if x.dtype() != DType::F32 || weight.dtype() != DType::F32 || options.groups != 1 {
        return None;
    }
    let (xd, wd) = (dims4(x), dims4(weight));
    if xd[1] != wd[1] {
        return None;
    }
    Geometry::new(xd, wd, options.stride, options.padding, options.dilation)
}

impl ConvBackend for Flex {
    fn conv2d_forward(
        x: FlexTensor,
        weight: FlexTensor,
        bias: Option<FlexTensor>,
        options: ConvOptions<2>,
    ) -> FlexTensor {
        let bias_ok = bias.as_ref().is_none_or(|b| b.dtype() == DType::F32);
        let Some(g) = flex_geometry(&x, &weight, &options).filter(|_| bias_ok) else {
            return Self::conv2d(x, weight, bias, options);
        };
        let (x, weight) = (contiguous(x), contiguous(weight));
        let bias = bias.map(contiguous);
        let y = cpu::forward(&g, values(&x), values(&weight), bias.as_ref().map(values));
        flex_f32(y, &[g.batch, g.c_out, g.out[0], g.out[1]])
    }

    fn conv2d_input_grad(
        x: FlexTensor,
        weight: FlexTensor,
        output_grad: FlexTensor,
        options: ConvOptions<2>,
    ) -> FlexTensor {
        let Some(g) = flex_geometry(&x, &weight, &options)
            .filter(|g| dims4(&output_grad) == [g.batch, g.c_out, g.out[0], g.out[1]])
        else {
            return Self::conv2d_x_backward(x, weight, output_grad, options);
        };
        let (weight, dy) = (contiguous(weight), contiguous(output_grad));
        let dx = cpu::input_grad(&g, values(&weight), values(&dy));
        flex_f32(dx, &[g.batch, g.c_in, g.height, g.width])
    }

    fn conv2d_weight_grad(
        x: FlexTensor,
        weight: FlexTensor,
        output_grad: FlexTensor,
        options: ConvOptions<2>,
    ) -> FlexTensor {
        let Some(g) = flex_geometry(&x, &weight, &options)
            .filter(|g| dims4(&output_grad) == [g.batch, g.c_out, g.out[0], g.out[1]])
        else {
            return Self::conv2d_weight_backward(x, weight, output_grad, options);
        };
        let (x, dy) = (contiguous(x), contiguous(output_grad));
        let dw = cpu::weight_grad(&g, values(&x), values(&dy));
        flex_f32(dw, &[g.c_out, g.c_in, g.kernel[0], g.kernel[1]])
    }

    fn conv2d_bias_grad(x: FlexTensor, bias: FlexTensor, output_grad: FlexTensor) -> FlexTensor {
        if output_grad.dtype() != DType::F32 || output_grad.shape().num_dims() != 4 {
            return Self::conv2d_bias_backward(x, bias, output_grad);
        }
        let [n, c, h, w] = dims4(&output_grad);
        let dy = contiguous(output_grad);
        // Only the batch, channel and pixel counts matter for the bias.
        let g = Geometry {
            batch: n,
            c_in: 0,
            height: 0,
            width: 0,
            c_out: c,
            kernel: [1, 1],
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            out: [h, w],
        };
        let db = cpu::bias_grad(&g, values(&dy));
        flex_f32(db, &[c])
    }
}

impl<B: ConvBackend, C: CheckpointStrategy> ConvBackend for Autodiff<B, C> {
    fn conv2d_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct ConvWithBias;
        #[derive(Debug)]
        struct ConvNoBias;

        impl<B: ConvBackend> Backward<B, 3> for ConvWithBias {
            type State = (NodeId, NodeId, NodeId, ConvOptions<2>);

            fn backward(
                self,
                ops: Ops<Self::State, 3>,
                grads: &mut Gradients,
                checkpointer: &mut Checkpointer,
            ) {
                let [node_x, node_weight, node_bias] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (x_state, weight_state, bias_state, options) = ops.state;
                let x: FloatTensor<B> = checkpointer.retrieve_node_output(x_state);
                let weight: FloatTensor<B> = checkpointer.retrieve_node_output(weight_state);
                let bias: FloatTensor<B> = checkpointer.retrieve_node_output(bias_state);
                if let Some(node) = node_x {
                    let dx = B::conv2d_input_grad(
                        x.clone(),
                        weight.clone(),
                        grad.clone(),
                        options.clone(),
                    );
                    grads.register::<B>(node.id, dx);
                }
                if let Some(node) = node_weight {
                    let dw = B::conv2d_weight_grad(x.clone(), weight, grad.clone(), options);
                    grads.register::<B>(node.id, dw);
                }
                if let Some(node) = node_bias {
                    grads.register::<B>(node.id, B::conv2d_bias_grad(x, bias, grad));
                }
            }
        }

        impl<B: ConvBackend> Backward<B, 2> for ConvNoBias {
            type State = (NodeId, NodeId, ConvOptions<2>);

            fn backward(
                self,
                ops: Ops<Self::State, 2>,
                grads: &mut Gradients,
                checkpointer: &mut Checkpointer,
            ) {
                let [node_x, node_weight] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (x_state, weight_state, options) = ops.state;
                let x: FloatTensor<B> = checkpointer.retrieve_node_output(x_state);
                let weight: FloatTensor<B> = checkpointer.retrieve_node_output(weight_state);
                if let Some(node) = node_x {
                    let dx = B::conv2d_input_grad(
                        x.clone(),
                        weight.clone(),
                        grad.clone(),
                        options.clone(),
                    );
                    grads.register::<B>(node.id, dx);
                }
                if let Some(node) = node_weight {
                    grads.register::<B>(node.id, B::conv2d_weight_grad(x, weight, grad, options));
                }
            }
        }

        match bias {
            Some(bias) => match ConvWithBias
                .prepare::<C>([x.node.clone(), weight.node.clone(), bias.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(mut prep) => {
                    let x_state = prep.checkpoint(&x);
                    let weight_state = prep.checkpoint(&weight);
                    let bias_state = prep.checkpoint(&bias);
                    let out = B::conv2d_forward(
                        x.primitive,
                        weight.primitive,
                        Some(bias.primitive),
                        options.clone(),
                    );
                    prep.finish((x_state, weight_state, bias_state, options), out)
                }
                OpsKind::UnTracked(prep) => prep.finish(B::conv2d_forward(
                    x.primitive,
                    weight.primitive,
                    Some(bias.primitive),
                    options,
                )),
            },
            None => match ConvNoBias
                .prepare::<C>([x.node.clone(), weight.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(mut prep) => {
                    let x_state = prep.checkpoint(&x);
                    let weight_state = prep.checkpoint(&weight);
                    let out =
                        B::conv2d_forward(x.primitive, weight.primitive, None, options.clone());
                    prep.finish((x_state, weight_state, options), out)
                }
                OpsKind::UnTracked(prep) => prep.finish(B::conv2d_forward(
                    x.primitive,
                    weight.primitive,
                    None,
                    options,
                )),
            },
        }
    }
}
