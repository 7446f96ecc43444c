//! The per-plane transforms of [`super`]: the 2×2 output tiles of a plane in groups of 16
//! ([`Taps`]), the arithmetic of one tile ([`input_points`], [`output_grad_points`],
//! [`output_values`]) on one lane or 16, and the choice between the AVX-512 kernels
//! ([`super::avx512`]) and the scalar reference.

#[cfg(target_arch = "x86_64")]
use super::avx512;
use super::{Grid, POINTS};

/// For every group of 16 tiles (numbered row by row, plane after plane) and every position of
/// a tile's patch: the offset of each lane's value and the lanes inside their plane. Tiles
/// across lanes keep all 16 lanes busy whatever a plane's width; a [`Stack`] of planes fills
/// them where one plane has fewer than 16 tiles (ResNet's 4×4 and 2×2 planes at 32 px).
pub(super) struct Taps {
    /// Tiles in the stack of planes.
    tiles: usize,
    /// Positions per tile: 16 for a 4×4 input patch, 4 for a 2×2 output tile.
    pub(super) positions: usize,
    /// `[group][position]`: a lane's offset from the first plane (0 where masked off).
    pub(super) offsets: Vec<[i32; LANES]>,
    /// `[group][position]`: bit `l` set where lane `l` is a tile and inside its plane.
    pub(super) masks: Vec<u16>,
    /// One past the largest offset: the length the transforms' planes must have.
    pub(super) extent: usize,
    /// Where each group's tiles lie in whole planes that fit one [`Window`] together.
    pub(super) window: Option<Window>,
}

/// Values a [`Window`] holds: four AVX-512 registers.
pub(super) const WINDOW: usize = 64;

/// The planes of a group of 16 tiles, side by side, when they fit [`WINDOW`] values: 8×8 and
/// 7×7 planes alone, 4×4 and 3×3 by 4, 2×2 and 1×1 by 16. The AVX-512 transforms load them
/// into four registers and pick each position's 16 values with two permutes, not a gather
/// (16 loads, each through the cache, on the CPUs measured).
pub(super) struct Window {
    /// Planes per group: the tiles of `planes` whole planes fill its 16 lanes.
    pub(super) planes: usize,
    /// Values in a plane.
    pub(super) plane_len: usize,
    /// The distance between the stack's planes, and their number.
    pub(super) stride: usize,
    pub(super) count: usize,
    /// `[group][position]`: each lane's value at `places[..][lane]` in its group's window (0
    /// where masked off).
    pub(super) places: Vec<[i32; LANES]>,
    /// Output taps only, `[group][register]`: for each value of the window, the `position · 16
    /// + lane` of the tile value that goes there (the inverse of `places`).
    pub(super) sources: Vec<[[i32; LANES]; WINDOW / LANES]>,
}

impl Window {
    /// Values of the stack a window reads: every value of its planes.
    fn extent(&self) -> usize {
        self.count.saturating_sub(1) * self.stride + self.plane_len
    }

    /// Where plane `local` of `group` starts in the stack; `None` past the stack's last plane
    /// (the last group may hold fewer than `planes`).
    pub(super) fn start(&self, group: usize, local: usize) -> Option<usize> {
        let index = group * self.planes + local;
        (local < self.planes && index < self.count).then(|| index * self.stride)
    }
}

/// Tiles per vector.
pub(super) const LANES: usize = 16;

/// `count` planes `stride` values apart, transformed in one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Stack {
    pub(super) count: usize,
    pub(super) stride: usize,
}

impl Stack {
    /// One plane.
    pub(super) const ONE: Stack = Stack {
        count: 1,
        stride: 0,
    };
}

impl Taps {
    /// The `side × side` patches at `(2i − pad[0], 2j − pad[1])` of `stack`'s planes, each
    /// `[height, width]`.
    fn new(
        grid: &Grid,
        side: usize,
        pad: [usize; 2],
        [height, width]: [usize; 2],
        stack: Stack,
    ) -> Self {
        let [th, tw] = grid.tiles;
        let per_plane = th * tw;
        let tiles = per_plane * stack.count;
        let positions = side * side;
        let groups = tiles.div_ceil(LANES);
        let mut offsets = vec![[0i32; LANES]; groups * positions];
        let mut masks = vec![0u16; groups * positions];
        let mut extent = 0;
        let plane_len = height * width;
        let window_planes = (per_plane > 0 && LANES.is_multiple_of(per_plane))
            .then(|| LANES / per_plane)
            .filter(|planes| planes * plane_len <= WINDOW);
        let with_window = |len: usize| if window_planes.is_some() { len } else { 0 };
        let mut places = vec![[0i32; LANES]; with_window(groups * positions)];
        // Output tiles (4 positions) cover each pixel once, so each value of the window has
        // one source.
        let mut sources =
            vec![[[0i32; LANES]; WINDOW / LANES]; with_window(if side == 2 { groups } else { 0 })];
        for t in 0..tiles {
            let (group, lane) = (t / LANES, t % LANES);
            let (k, tile) = (t / per_plane, t % per_plane);
            let (i, j) = (tile / tw, tile % tw);
            for r in 0..side {
                for c in 0..side {
                    let (Some(y), Some(x)) = (
                        (2 * i + r).checked_sub(pad[0]),
                        (2 * j + c).checked_sub(pad[1]),
                    ) else {
                        continue;
                    };
                    if y < height && x < width {
                        let offset = k * stack.stride + y * width + x;
                        let at = group * positions + r * side + c;
                        offsets[at][lane] = i32::try_from(offset).expect(
                            "winograd: a stack of planes past 2³¹ values (Planes::new checks)",
                        );
                        masks[at] |= 1 << lane;
                        extent = extent.max(offset + 1);
                        if let Some(planes) = window_planes {
                            // Below WINDOW (64): fits an i32.
                            let place = (k % planes) * plane_len + y * width + x;
                            places[at][lane] = place as i32;
                            if side == 2 {
                                sources[group][place / LANES][place % LANES] =
                                    ((r * side + c) * LANES + lane) as i32;
                            }
                        }
                    }
                }
            }
        }
        let window = window_planes.map(|planes| Window {
            planes,
            plane_len,
            stride: stack.stride,
            count: stack.count,
            places,
            sources,
        });
        Self {
            tiles,
            positions,
            offsets,
            masks,
            extent,
            window,
        }
    }

    /// The length a plane (or stack) must have: past every tap, and every value of its planes
    /// where the AVX-512 transforms read whole planes ([`Window`]).
    fn required_len(&self) -> usize {
        self.window
            .as_ref()
            .map_or(self.extent, |window| window.extent().max(self.extent))
    }

    pub(super) fn groups(&self) -> usize {
        self.tiles.div_ceil(LANES)
    }

    /// Lanes of `group` that hold tiles: all 16 but in the last group.
    pub(super) fn lanes(&self, group: usize) -> u16 {
        first_lanes(self.tiles - group * LANES)
    }
}

/// Lanes `0..n` as a mask: all 16 from `n = 16` on.
#[inline(always)]
pub(super) fn first_lanes(n: usize) -> u16 {
    ((1u32 << n.min(LANES)) - 1) as u16
}

/// How the per-plane transforms run: 16 tiles per AVX-512 vector, or one tile at a time (the
/// reference, on CPUs without AVX-512: [`applies`] keeps those on im2col). Both give the same
/// values: the same operations in the same order for each tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kernel {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    Scalar,
}

impl Kernel {
    pub(super) fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Kernel::Avx512;
        }
        Kernel::Scalar
    }
}

/// `Bᵀ d B` of the 4×4 patch `d` (row-major), `Bᵀ = [[1, 0, −1, 0], [0, 1, 1, 0], [0, −1, 1, 0],
/// [0, 1, 0, −1]]`: over the rows, then over the columns. Generic over the lane type so that the
/// scalar and vector paths share the arithmetic.
#[inline(always)]
pub(super) fn input_points<T: Lane>(d: [T; POINTS]) -> [T; POINTS] {
    // Written out: loops over a match, or closures, are not always inlined into the AVX-512
    // functions, and their intrinsics then become calls.
    let [
        d0,
        d1,
        d2,
        d3,
        d4,
        d5,
        d6,
        d7,
        d8,
        d9,
        d10,
        d11,
        d12,
        d13,
        d14,
        d15,
    ] = d;
    // Bᵀ over the rows, per column.
    let t0 = [d0.sub(d8), d1.sub(d9), d2.sub(d10), d3.sub(d11)];
    let t1 = [d4.add(d8), d5.add(d9), d6.add(d10), d7.add(d11)];
    let t2 = [d8.sub(d4), d9.sub(d5), d10.sub(d6), d11.sub(d7)];
    let t3 = [d4.sub(d12), d5.sub(d13), d6.sub(d14), d7.sub(d15)];
    // B over the columns, per row.
    [
        t0[0].sub(t0[2]),
        t0[1].add(t0[2]),
        t0[2].sub(t0[1]),
        t0[1].sub(t0[3]),
        t1[0].sub(t1[2]),
        t1[1].add(t1[2]),
        t1[2].sub(t1[1]),
        t1[1].sub(t1[3]),
        t2[0].sub(t2[2]),
        t2[1].add(t2[2]),
        t2[2].sub(t2[1]),
        t2[1].sub(t2[3]),
        t3[0].sub(t3[2]),
        t3[1].add(t3[2]),
        t3[2].sub(t3[1]),
        t3[1].sub(t3[3]),
    ]
}

/// `A e Aᵀ` of the 2×2 tile `e` (row-major), `A = [[1, 0], [1, 1], [1, −1], [0, −1]]`: over
/// the rows (per column), then over the columns. Written out, as [`input_points`].
#[inline(always)]
pub(super) fn output_grad_points<T: Lane>(e: [T; 4]) -> [T; POINTS] {
    let [e00, e01, e10, e11] = e;
    let c0 = [e00, e00.add(e10), e00.sub(e10), e10.neg()];
    let c1 = [e01, e01.add(e11), e01.sub(e11), e11.neg()];
    [
        c0[0],
        c0[0].add(c1[0]),
        c0[0].sub(c1[0]),
        c1[0].neg(),
        c0[1],
        c0[1].add(c1[1]),
        c0[1].sub(c1[1]),
        c1[1].neg(),
        c0[2],
        c0[2].add(c1[2]),
        c0[2].sub(c1[2]),
        c1[2].neg(),
        c0[3],
        c0[3].add(c1[3]),
        c0[3].sub(c1[3]),
        c1[3].neg(),
    ]
}

/// `Aᵀ m A + bias` of one tile's 16 points, `Aᵀ = [[1, 1, 1, 0], [0, 1, −1, −1]]`: the 2×2
/// outputs, row-major.
#[inline(always)]
pub(super) fn output_values<T: Lane>(m: [T; POINTS], bias: T) -> [T; 4] {
    let s0 = [
        m[0].add(m[4]).add(m[8]),
        m[1].add(m[5]).add(m[9]),
        m[2].add(m[6]).add(m[10]),
        m[3].add(m[7]).add(m[11]),
    ];
    let s1 = [
        m[4].sub(m[8]).sub(m[12]),
        m[5].sub(m[9]).sub(m[13]),
        m[6].sub(m[10]).sub(m[14]),
        m[7].sub(m[11]).sub(m[15]),
    ];
    [
        s0[0].add(s0[1]).add(s0[2]).add(bias),
        s0[1].sub(s0[2]).sub(s0[3]).add(bias),
        s1[0].add(s1[1]).add(s1[2]).add(bias),
        s1[1].sub(s1[2]).sub(s1[3]).add(bias),
    ]
}

/// The arithmetic the transforms need, on one value or on 16.
pub(super) trait Lane: Copy {
    fn add(self, other: Self) -> Self;
    fn sub(self, other: Self) -> Self;
    fn neg(self) -> Self;
}

impl Lane for f32 {
    #[inline(always)]
    fn add(self, other: Self) -> Self {
        self + other
    }
    #[inline(always)]
    fn sub(self, other: Self) -> Self {
        self - other
    }
    #[inline(always)]
    fn neg(self) -> Self {
        -self
    }
}

/// Below this many tiles per row the AVX-512 transforms gather patches tile by tile across
/// rows; from it on they read rows of 16 tiles with plain loads.
pub(super) const ROW_TILES: usize = 8;

/// What the per-plane transforms of one pass share: the grid, its taps, and how they run.
pub(super) struct Planes {
    kernel: Kernel,
    pub(super) grid: Grid,
    /// Planes per call of [`transform_input`], [`transform_output_grad`] and
    /// [`transform_output`] (one, or a [`Stack`]).
    pub(super) stacked: bool,
    input: Taps,
    output: Taps,
}

impl Planes {
    /// One plane per call.
    pub(super) fn new(kernel: Kernel, grid: Grid) -> Self {
        Self::with_stacks(kernel, grid, Stack::ONE, Stack::ONE)
    }

    /// Stacks of planes per call where the transforms gather (planes narrower than
    /// [`ROW_TILES`] tiles), one plane per call where they read rows: input planes as
    /// `input`, output (or output-gradient) planes as `output`.
    pub(super) fn stacked(kernel: Kernel, grid: Grid, input: Stack, output: Stack) -> Self {
        let one = Self::new(kernel, grid);
        let span = |s: Stack, len: usize| s.count.saturating_sub(1) * s.stride + len;
        let fits = span(input, grid.in_len()) <= i32::MAX as usize
            && span(output, grid.out_len()) <= i32::MAX as usize;
        if one.by_rows() || !fits {
            return one;
        }
        Self::with_stacks(kernel, grid, input, output)
    }

    fn with_stacks(kernel: Kernel, grid: Grid, input: Stack, output: Stack) -> Self {
        Self {
            kernel,
            stacked: input != Stack::ONE,
            input: Taps::new(&grid, 4, grid.pad, [grid.height, grid.width], input),
            output: Taps::new(&grid, 2, [0, 0], grid.out, output),
            grid,
        }
    }

    /// Whether the AVX-512 transforms read whole rows of tiles ([`ROW_TILES`]).
    fn by_rows(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self.kernel == Kernel::Avx512 {
            return self.grid.tiles[1] >= ROW_TILES;
        }
        false
    }

    /// Rows of the zero-padded input plane that [`transform_input`] reads by rows:
    /// `2·tiles + 2` rows, wide enough for every group's loads (two rows of 16 tiles plus 2).
    pub(super) fn padded_shape(&self) -> [usize; 2] {
        let [th, tw] = self.grid.tiles;
        [2 * th + 2, 2 * LANES * tw.div_ceil(LANES) + 2]
    }

    /// A zeroed buffer for the padded plane (empty when not reading by rows): one per task, its
    /// padding written once, its interior by every plane.
    pub(super) fn padded(&self) -> Vec<f32> {
        if !self.by_rows() {
            return Vec::new();
        }
        let [rows_, width] = self.padded_shape();
        vec![0.0; rows_ * width]
    }
}

/// The transformed tiles of one input plane: point ξ of tile `t` goes to `v[ξ·stride + t]`.
pub(super) fn transform_input(
    planes: &Planes,
    padded: &mut [f32],
    plane: &[f32],
    v: &mut [f32],
    stride: usize,
) {
    let taps = &planes.input;
    assert!(
        plane.len() >= taps.required_len(),
        "winograd: an input plane shorter than its taps"
    );
    match planes.kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Kernel::Avx512 is only chosen where the CPU has AVX-512F; `padded` comes from
        // `planes.padded()`.
        Kernel::Avx512 => unsafe {
            if planes.by_rows() && taps.window.is_none() {
                avx512::transform_input_rows(
                    &planes.grid,
                    planes.padded_shape(),
                    padded,
                    plane,
                    v,
                    stride,
                )
            } else {
                avx512::transform_input(taps, plane, v, stride)
            }
        },
        Kernel::Scalar => {
            for_each_tile(taps, |group, lane, t| {
                let d = std::array::from_fn(|pos| taps.value(plane, group, pos, lane));
                for (xi, value) in input_points(d).into_iter().enumerate() {
                    v[xi * stride + t] = value;
                }
            });
        }
    }
}

/// The transformed 2×2 tiles of one output-gradient plane: point ξ of tile `t` goes to
/// `e[ξ·stride + t]`.
pub(super) fn transform_output_grad(planes: &Planes, plane: &[f32], e: &mut [f32], stride: usize) {
    let taps = &planes.output;
    assert!(
        plane.len() >= taps.required_len(),
        "winograd: a gradient plane shorter than its taps"
    );
    match planes.kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in transform_input.
        Kernel::Avx512 => unsafe {
            if planes.by_rows() && taps.window.is_none() {
                avx512::transform_output_grad_rows(&planes.grid, plane, e, stride)
            } else {
                avx512::transform_output_grad(taps, plane, e, stride)
            }
        },
        Kernel::Scalar => {
            for_each_tile(taps, |group, lane, t| {
                let d = std::array::from_fn(|pos| taps.value(plane, group, pos, lane));
                for (xi, value) in output_grad_points(d).into_iter().enumerate() {
                    e[xi * stride + t] = value;
                }
            });
        }
    }
}

/// One output plane from its tiles' products (point ξ of tile `t` at `m[ξ·stride + t]`), plus
/// `bias`.
pub(super) fn transform_output(
    planes: &Planes,
    m: &[f32],
    stride: usize,
    plane: &mut [f32],
    bias: f32,
) {
    let taps = &planes.output;
    assert!(
        plane.len() >= taps.required_len(),
        "winograd: an output plane shorter than its taps"
    );
    match planes.kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in transform_input.
        Kernel::Avx512 => unsafe {
            if planes.by_rows() && taps.window.is_none() {
                avx512::transform_output_rows(&planes.grid, m, stride, plane, bias)
            } else {
                avx512::transform_output(taps, m, stride, plane, bias)
            }
        },
        Kernel::Scalar => {
            for_each_tile(taps, |group, lane, t| {
                let points = std::array::from_fn(|xi| m[xi * stride + t]);
                for (pos, value) in output_values(points, bias).into_iter().enumerate() {
                    let at = group * taps.positions + pos;
                    if taps.masks[at] & (1 << lane) != 0 {
                        plane[taps.offsets[at][lane] as usize] = value;
                    }
                }
            });
        }
    }
}

/// Calls `f(group, lane, tile)` for every tile of a plane.
fn for_each_tile(taps: &Taps, mut f: impl FnMut(usize, usize, usize)) {
    for t in 0..taps.tiles {
        f(t / LANES, t % LANES, t);
    }
}

impl Taps {
    /// The plane's value at a tap, 0 where masked off.
    fn value(&self, plane: &[f32], group: usize, pos: usize, lane: usize) -> f32 {
        let at = group * self.positions + pos;
        if self.masks[at] & (1 << lane) != 0 {
            plane[self.offsets[at][lane] as usize]
        } else {
            0.0
        }
    }
}
