//! cuDNN convolutions on raw device pointers, one handle per thread.
//!
//! `libcudnn` is loaded at run time by cudarc. Stream ordering: Burn's compute stream is not
//! reachable from outside cubecl, so each call waits for the device (the caller syncs Burn's
//! work), runs cuDNN on a stream of its own in the primary context that cubecl also uses, and
//! synchronises that stream before handing the output back. That costs one device round trip
//! per conv call (three per conv per step), which is the price of not sharing Burn's stream.
//!
//! Math: strict fp32 (`CUDNN_FMA_MATH`) by default, so results match Burn's conv to float
//! rounding; `BURN_HOROVOD_CUDNN_TF32=1` allows TF32 tensor cores (PyTorch's default for convs).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, OnceLock};

use cudarc::cudnn::{result as dnn, sys};
use cudarc::driver::{CudaContext, CudaStream};

use super::layout::TensorLayout;

/// The largest workspace an algorithm may ask for.
const WORKSPACE_LIMIT: usize = 1 << 30;

/// Which of the three convolutions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Pass {
    Forward,
    InputGrad,
    WeightGrad,
}

/// Shapes and options of one call: x `[N, Ci, H, W]`, w `[Co, Ci, kh, kw]`, y `[N, Co, Ho, Wo]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Problem {
    pub x: [usize; 4],
    pub w: [usize; 4],
    pub y: [usize; 4],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    /// The three tensors are bf16 (cuDNN still accumulates in f32), not f32.
    pub bf16: bool,
}

/// Device addresses of one call's tensors (f32 or bf16 as the problem says), laid out as their
/// [`Layouts`] say.
pub(crate) struct Pointers {
    pub x: u64,
    pub w: u64,
    pub y: u64,
}

/// The memory layouts of one call's tensors: x and y (dy) with their real strides (cubecl pads
/// rows, see [`super::layout`]), w packed (filter descriptors take no strides).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Layouts {
    pub x: TensorLayout,
    pub w: TensorLayout,
    pub y: TensorLayout,
}

/// Why cuDNN cannot run here, or `None` if it can: probed once per process.
pub(crate) fn unavailable() -> Option<&'static str> {
    static PROBE: OnceLock<Option<String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            // SAFETY: only tries to dlopen the library; calls nothing in it.
            probe(&burn_dist::cuda_libs::find(), || unsafe {
                sys::is_culib_present()
            })
        })
        .as_deref()
}

/// Why cuDNN cannot run with the libraries `libs` found, or `None`: a `libcudnn.so.9` whose
/// folder holds its sub-libraries, and that cudarc loads (`loads`). cuDNN 9's shim without its
/// sub-libraries aborts the process in `cudnnCreate`, so a shim alone is not enough.
pub(crate) fn probe(
    libs: &burn_dist::cuda_libs::CudaLibraries,
    loads: impl FnOnce() -> bool,
) -> Option<String> {
    use burn_dist::cuda_libs::CudaLibrary;
    let found = match libs.require(CudaLibrary::Cudnn) {
        Ok(found) => found,
        Err(missing) => return Some(missing.to_string()),
    };
    if !loads() {
        return Some(format!(
            "{} is there, but cudarc does not load it: start the program through \
             burn_dist::cuda_libs::prepare() or put {} on LD_LIBRARY_PATH",
            found.path.display(),
            found.folder().display()
        ));
    }
    None
}

/// The one line printed when cuDNN is missing.
pub(crate) fn fallback_message(reason: &str) -> String {
    format!("--conv fast on CUDA: {reason}; until then convs use Burn's own kernels")
}

/// A cuDNN failure, with the call that failed.
#[derive(Debug)]
pub(crate) struct CudnnFailure(pub String);

fn fail<E: std::fmt::Debug>(what: &str) -> impl Fn(E) -> CudnnFailure + '_ {
    move |e| CudnnFailure(format!("{what}: {e:?}"))
}

struct Workspace {
    ptr: u64,
    bytes: usize,
}

struct State {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    handle: sys::cudnnHandle_t,
    workspace: Workspace,
    algos: HashMap<(Pass, Problem, Layouts), (Algo, usize)>,
}

impl State {
    fn new(device: usize) -> Result<Self, CudnnFailure> {
        let ctx = CudaContext::new(device).map_err(fail("retaining the CUDA context"))?;
        ctx.bind_to_thread()
            .map_err(fail("binding the CUDA context"))?;
        let stream = ctx.new_stream().map_err(fail("creating a stream"))?;
        let handle = dnn::create_handle().map_err(fail("cudnnCreate"))?;
        // SAFETY: `handle` was just created and the stream belongs to the bound context.
        unsafe { dnn::set_stream(handle, stream.cu_stream() as sys::cudaStream_t) }
            .map_err(fail("cudnnSetStream"))?;
        Ok(Self {
            ctx,
            stream,
            handle,
            workspace: Workspace { ptr: 0, bytes: 0 },
            algos: HashMap::new(),
        })
    }

    fn workspace(&mut self, bytes: usize) -> Result<u64, CudnnFailure> {
        if bytes > self.workspace.bytes {
            if self.workspace.ptr != 0 {
                // SAFETY: allocated below by `malloc_sync`, and no launch uses it: every call
                // synchronises its stream before returning.
                unsafe { cudarc::driver::result::free_sync(self.workspace.ptr) }
                    .map_err(fail("freeing the workspace"))?;
                self.workspace = Workspace { ptr: 0, bytes: 0 };
            }
            // SAFETY: the context is bound to this thread (see `run`).
            let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes) }
                .map_err(fail("allocating the workspace"))?;
            self.workspace = Workspace { ptr, bytes };
        }
        Ok(self.workspace.ptr)
    }
}

impl Drop for State {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        if self.workspace.ptr != 0 {
            // SAFETY: our allocation; nothing runs on it (every call synchronised).
            let _ = unsafe { cudarc::driver::result::free_sync(self.workspace.ptr) };
        }
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { dnn::destroy_handle(self.handle) };
    }
}

thread_local! {
    static STATES: RefCell<HashMap<usize, State>> = RefCell::new(HashMap::new());
}

/// An algorithm as cuDNN names it for its pass.
#[derive(Debug, Clone, Copy)]
enum Algo {
    Forward(sys::cudnnConvolutionFwdAlgo_t),
    InputGrad(sys::cudnnConvolutionBwdDataAlgo_t),
    WeightGrad(sys::cudnnConvolutionBwdFilterAlgo_t),
}

/// Descriptors of one problem, destroyed on drop.
struct Descriptors {
    x: sys::cudnnTensorDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
    w: sys::cudnnFilterDescriptor_t,
    conv: sys::cudnnConvolutionDescriptor_t,
}

impl Descriptors {
    fn new(p: &Problem, layouts: &Layouts) -> Result<Self, CudnnFailure> {
        let dims = |d: [usize; 4]| d.map(|v| v as c_int);
        if layouts.x.dims != dims(p.x) || layouts.y.dims != dims(p.y) || layouts.w.dims != dims(p.w)
        {
            return Err(CudnnFailure(format!(
                "the tensors' shapes {layouts:?} are not the problem's {p:?}"
            )));
        }
        if !layouts.w.is_packed() {
            return Err(CudnnFailure(format!(
                "the filter's strides {:?} are not packed NCHW, which is all a cuDNN filter \
                 descriptor describes",
                layouts.w.strides
            )));
        }
        // The conv's compute type stays f32 in both cases: bf16 storage, f32 accumulation.
        let f32_ = sys::cudnnDataType_t::CUDNN_DATA_FLOAT;
        let data = if p.bf16 {
            sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16
        } else {
            f32_
        };
        let nchw = sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
        let d = Self {
            x: dnn::create_tensor_descriptor().map_err(fail("tensor descriptor"))?,
            y: dnn::create_tensor_descriptor().map_err(fail("tensor descriptor"))?,
            w: dnn::create_filter_descriptor().map_err(fail("filter descriptor"))?,
            conv: dnn::create_convolution_descriptor().map_err(fail("conv descriptor"))?,
        };
        let [ph, pw] = [p.padding[0] as c_int, p.padding[1] as c_int];
        let [sh, sw] = [p.stride[0] as c_int, p.stride[1] as c_int];
        let [dh, dw] = [p.dilation[0] as c_int, p.dilation[1] as c_int];
        let tf32 = std::env::var("BURN_HOROVOD_CUDNN_TF32").is_ok_and(|v| v == "1");
        // bf16 needs tensor cores (DEFAULT allows them); strict FMA math would refuse it.
        let math = if tf32 || p.bf16 {
            sys::cudnnMathType_t::CUDNN_DEFAULT_MATH
        } else {
            sys::cudnnMathType_t::CUDNN_FMA_MATH
        };
        // SAFETY: all four descriptors were created above and are set once each.
        unsafe {
            // The real strides: cubecl pads rows (W = 7 f32 rows are 8 floats apart), and a
            // packed descriptor would make cuDNN read and write the wrong elements.
            dnn::set_tensor4d_descriptor_ex(d.x, data, layouts.x.dims, layouts.x.strides)
                .map_err(fail("x desc"))?;
            dnn::set_tensor4d_descriptor_ex(d.y, data, layouts.y.dims, layouts.y.strides)
                .map_err(fail("y desc"))?;
            dnn::set_filter4d_descriptor(d.w, data, nchw, layouts.w.dims)
                .map_err(fail("w desc"))?;
            dnn::set_convolution2d_descriptor(
                d.conv,
                ph,
                pw,
                sh,
                sw,
                dh,
                dw,
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                f32_,
            )
            .map_err(fail("conv desc"))?;
            dnn::set_convolution_math_type(d.conv, math).map_err(fail("math type"))?;
        }
        Ok(d)
    }
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        unsafe {
            let _ = dnn::destroy_tensor_descriptor(self.x);
            let _ = dnn::destroy_tensor_descriptor(self.y);
            let _ = dnn::destroy_filter_descriptor(self.w);
            let _ = dnn::destroy_convolution_descriptor(self.conv);
        }
    }
}

/// The first algorithm cuDNN's heuristics rank that works within [`WORKSPACE_LIMIT`], and its
/// workspace in bytes.
fn choose(
    handle: sys::cudnnHandle_t,
    pass: Pass,
    d: &Descriptors,
) -> Result<(Algo, usize), CudnnFailure> {
    const N: usize = 8;
    let mut count: c_int = 0;
    let ok = sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS;
    // SAFETY: the perf arrays hold N entries, as requested; handle and descriptors are live.
    // cuDNN fills `count` entries, and the all-zero bit pattern of each plain C struct is valid.
    let ranked: Vec<(Algo, usize)> = unsafe {
        match pass {
            Pass::Forward => {
                let mut perf = [std::mem::zeroed::<sys::cudnnConvolutionFwdAlgoPerf_t>(); N];
                dnn::get_convolution_forward_algorithm(
                    handle,
                    d.x,
                    d.w,
                    d.conv,
                    d.y,
                    N as c_int,
                    &mut count,
                    perf.as_mut_ptr(),
                )
                .map_err(fail("choosing the forward algorithm"))?;
                perf[..count as usize]
                    .iter()
                    .filter(|p| p.status == ok)
                    .map(|p| (Algo::Forward(p.algo), p.memory))
                    .collect()
            }
            Pass::InputGrad => {
                let mut perf = [std::mem::zeroed::<sys::cudnnConvolutionBwdDataAlgoPerf_t>(); N];
                dnn::get_convolution_backward_data_algorithm(
                    handle,
                    d.w,
                    d.y,
                    d.conv,
                    d.x,
                    N as c_int,
                    &mut count,
                    perf.as_mut_ptr(),
                )
                .map_err(fail("choosing the backward-data algorithm"))?;
                perf[..count as usize]
                    .iter()
                    .filter(|p| p.status == ok)
                    .map(|p| (Algo::InputGrad(p.algo), p.memory))
                    .collect()
            }
            Pass::WeightGrad => {
                let mut perf = [std::mem::zeroed::<sys::cudnnConvolutionBwdFilterAlgoPerf_t>(); N];
                dnn::get_convolution_backward_filter_algorithm(
                    handle,
                    d.x,
                    d.y,
                    d.conv,
                    d.w,
                    N as c_int,
                    &mut count,
                    perf.as_mut_ptr(),
                )
                .map_err(fail("choosing the backward-filter algorithm"))?;
                perf[..count as usize]
                    .iter()
                    .filter(|p| p.status == ok)
                    .map(|p| (Algo::WeightGrad(p.algo), p.memory))
                    .collect()
            }
        }
    };
    ranked
        .into_iter()
        .find(|(_, bytes)| *bytes <= WORKSPACE_LIMIT)
        .ok_or_else(|| {
            CudnnFailure(format!(
                "no {pass:?} algorithm fits {WORKSPACE_LIMIT} bytes"
            ))
        })
}

/// Runs one pass on `device`: forward writes `y`, input grad writes `x` (from `w`, `y` = dy),
/// weight grad writes `w` (from `x`, `y` = dy). Returns once the result is on the device.
///
/// # Safety
/// The pointers address buffers of the problem's dtype on `device` that hold every element
/// `layouts` reaches (checked by [`TensorLayout::describe`] against each buffer's size), alive
/// until this returns; every kernel that writes the inputs has finished (the caller synchronised
/// Burn's work), and nothing reads the output before this returns.
pub(crate) unsafe fn run(
    device: usize,
    pass: Pass,
    problem: &Problem,
    layouts: &Layouts,
    ptr: &Pointers,
) -> Result<(), CudnnFailure> {
    STATES.with(|states| {
        let mut states = states.borrow_mut();
        let state = match states.entry(device) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(State::new(device)?),
        };
        state
            .ctx
            .bind_to_thread()
            .map_err(fail("binding the CUDA context"))?;
        let d = Descriptors::new(problem, layouts)?;
        let key = (pass, *problem, *layouts);
        let (algo, bytes) = match state.algos.get(&key) {
            Some(choice) => *choice,
            None => {
                let choice = choose(state.handle, pass, &d).map_err(|e| {
                    CudnnFailure(format!("{} for {problem:?} laid out as {layouts:?}", e.0))
                })?;
                state.algos.insert(key, choice);
                choice
            }
        };
        let workspace = state.workspace(bytes.max(1))? as *mut c_void;
        let (one, zero) = (1.0f32, 0.0f32);
        let alpha = &one as *const f32 as *const c_void;
        let beta = &zero as *const f32 as *const c_void;
        let (x, w, y) = (
            ptr.x as *mut c_void,
            ptr.w as *mut c_void,
            ptr.y as *mut c_void,
        );
        // SAFETY: the caller vouches for the buffers; descriptors describe them; the algorithm
        // value came from cuDNN for this pass; the workspace holds at least `bytes`.
        unsafe {
            match algo {
                Algo::Forward(algo) => dnn::convolution_forward(
                    state.handle,
                    alpha,
                    d.x,
                    x,
                    d.w,
                    w,
                    d.conv,
                    algo,
                    workspace,
                    bytes,
                    beta,
                    d.y,
                    y,
                ),
                Algo::InputGrad(algo) => dnn::convolution_backward_data(
                    state.handle,
                    alpha,
                    d.w,
                    w,
                    d.y,
                    y,
                    d.conv,
                    algo,
                    workspace,
                    bytes,
                    beta,
                    d.x,
                    x,
                ),
                Algo::WeightGrad(algo) => dnn::convolution_backward_filter(
                    state.handle,
                    alpha,
                    d.x,
                    x,
                    d.y,
                    y,
                    d.conv,
                    algo,
                    workspace,
                    bytes,
                    beta,
                    d.w,
                    w,
                ),
            }
        }
        .map_err(fail("launching the convolution"))?;
        state
            .stream
            .synchronize()
            .map_err(fail("synchronising the cuDNN stream"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_dist::cuda_libs::{CUDNN_SUB_LIBRARIES, find_in};

    fn touch(path: &std::path::Path) {
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, b"").expect("write");
    }

    /// The probe over fake folders: a shim without its sub-libraries is refused with the reason
    /// and the fix (cuDNN 9 would abort the process); nothing at all names the package.
    #[test]
    fn the_probe_refuses_a_shim_without_its_sub_libraries() {
        let root = tempfile::tempdir().expect("tempdir");
        let shim = root.path().join("shim");
        touch(&shim.join("libcudnn.so.9"));
        let libs = find_in(std::slice::from_ref(&shim));
        let reason = probe(&libs, || true).expect("not ready");
        for needle in [
            "libcudnn_cnn.so.9",
            "aborts",
            "nvidia-cudnn-cu12",
            "LD_LIBRARY_PATH",
        ] {
            assert!(reason.contains(needle), "{needle:?} missing from: {reason}");
        }
        let line = fallback_message(&reason);
        assert!(!line.contains('\n'), "one line: {line}");
        assert!(line.contains("Burn's own kernels"), "{line}");

        let empty = root.path().join("empty");
        std::fs::create_dir_all(&empty).expect("mkdir");
        let reason = probe(&find_in(&[empty]), || true).expect("nothing there");
        assert!(
            reason.contains("cuDNN") && reason.contains("was not found"),
            "{reason}"
        );
    }

    /// A complete folder is ready only when cudarc loads the library too; empty files named like
    /// the sub-libraries do not count (they must open).
    #[test]
    fn the_probe_needs_sub_libraries_that_open_and_a_library_cudarc_loads() {
        let root = tempfile::tempdir().expect("tempdir");
        let fake = root.path().join("fake");
        touch(&fake.join("libcudnn.so.9"));
        for name in CUDNN_SUB_LIBRARIES {
            touch(&fake.join(name));
        }
        let reason = probe(&find_in(std::slice::from_ref(&fake)), || true).expect("not libraries");
        assert!(reason.contains("cannot be opened"), "{reason}");

        // The real wheel, when a Python environment with it is active.
        let Some(venv) = std::env::var_os("VIRTUAL_ENV") else {
            return;
        };
        let env = |k: &str| (k == "VIRTUAL_ENV").then(|| venv.clone());
        let places = burn_dist::cuda_libs::search_places(&env, &[], root.path());
        let libs = find_in(&places);
        if libs.get(burn_dist::cuda_libs::CudaLibrary::Cudnn).is_none() {
            return;
        }
        assert_eq!(probe(&libs, || true), None, "the wheel is ready");
        let reason = probe(&libs, || false).expect("cudarc cannot load it");
        assert!(reason.contains("cuda_libs::prepare"), "{reason}");
    }
}
