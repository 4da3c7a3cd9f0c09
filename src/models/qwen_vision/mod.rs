//! What the Qwen vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) share: the 2-D rotary tables
//! in merge-block order (`rotary.rs`), attention within segments of rows (`attention.rs`), the
//! checks of a forward call's inputs, layer norms with f32 parameters, and `Pass`, which runs a
//! block's layers with the model's kernels and marks each stage.

pub(crate) mod attention;
pub(crate) mod config;
pub(crate) mod rotary;
pub(crate) mod weights;

use burn::tensor::Tensor;

use crate::models::error::ModelError;
use crate::models::tower::PatchLayout;
use crate::nn::LoraLinear;
use crate::ops::attention::AttentionKernel;
use crate::ops::kernels::Kernels;
use crate::ops::lora::LoraBatch;
use crate::ops::norm::{self, NormKernel};
use crate::ops::rotary::rotate_packed;
use crate::preprocess::grid_rows;
use crate::runtime::stages::{Stage, StageClock};

/// Refuses patches that do not match `grids` (`[rows, patch_len]`, every grid non-empty and a
/// multiple of the merge size).
pub(crate) fn check_inputs(
    dims: [usize; 2],
    grids: &[[usize; 3]],
    layout: PatchLayout,
) -> Result<(), ModelError> {
    let [rows, len] = dims;
    if grids.is_empty() {
        return Err(ModelError::Input(
            "no image: the grids are empty".to_owned(),
        ));
    }
    if let Some(g) = grids.iter().find(|g| g.contains(&0)) {
        return Err(ModelError::Input(format!("grid {g:?} has no patches")));
    }
    let expected_rows = grids
        .iter()
        .fold(0usize, |rows, grid| rows.saturating_add(grid_rows(grid)));
    if len != layout.patch_len() || rows != expected_rows {
        return Err(ModelError::Input(format!(
            "pixel values are [{rows}, {len}] but the grids need [{expected_rows}, {}]",
            layout.patch_len()
        )));
    }
    let m = layout.spatial_merge_size;
    if let Some(g) = grids.iter().find(|g| g[1] % m != 0 || g[2] % m != 0) {
        return Err(ModelError::Input(format!(
            "grid {g:?} is not a multiple of the merge size {m}"
        )));
    }
    Ok(())
}

/// LayerNorm epsilon of every layer norm in the Qwen towers and mergers.
const LAYER_NORM_EPS: f64 = 1e-6;

/// A layer norm's affine parameters, kept in f32 whatever the model computes in.
#[derive(Debug, Clone)]
pub(crate) struct LayerNorm {
    pub weight: Tensor<1>,
    pub bias: Tensor<1>,
}

impl LayerNorm {
    /// Normalises each row in f32, the affine parameters applied in f32 too (as PyTorch's
    /// autocast runs layer_norm: an f16 variance overflows), the result in `x`'s dtype, by
    /// `kernel` ([`norm::layer_norm`]).
    pub(crate) fn forward(&self, x: Tensor<2>, kernel: NormKernel) -> Tensor<2> {
        norm::layer_norm(x, &self.weight, &self.bias, LAYER_NORM_EPS, kernel)
    }
}

/// The largest buffer (in bytes) one operation makes unless told otherwise: it bounds the
/// attention scores of large images, on the CPU backend too.
pub const DEFAULT_BUFFER_LIMIT: u64 = 256 << 20;

/// The most tower rows, in whole merge blocks of `merge`² rows, whose row-wise buffers of the
/// given `widths` (f32 values) each fit `buffer_limit` bytes.
pub(crate) fn max_rows(buffer_limit: u64, merge: usize, widths: &[usize]) -> usize {
    let widest = widths.iter().copied().max().unwrap_or(1).max(1);
    let rows = buffer_limit / (4 * widest as u64);
    let m2 = merge * merge;
    usize::try_from(rows).unwrap_or(usize::MAX) / m2 * m2
}

/// The linears of Qwen2-VL's and Qwen2.5-VL's merger, by path.
pub(crate) const MERGER_LINEARS: [&str; 2] = ["merger.mlp.0", "merger.mlp.2"];

/// Each block's linears (`blocks`, in `names`' order) with their paths (`blocks.{i}.{name}`),
/// then the connector's (`mergers`, path and linear): the order of a tower's LoRA targets. `T`
/// is `&LoraLinear` or `&mut LoraLinear`.
pub(crate) fn named<T, const N: usize>(
    blocks: impl Iterator<Item = [T; N]>,
    names: [&'static str; N],
    mergers: impl IntoIterator<Item = (String, T)>,
) -> impl Iterator<Item = (String, T)> {
    let blocks = blocks.enumerate().flat_map(move |(i, linears)| {
        let paths = names.map(|name| format!("blocks.{i}.{name}"));
        paths.into_iter().zip(linears)
    });
    blocks.chain(mergers)
}

/// `linears` with the paths of [`MERGER_LINEARS`], for [`named`].
pub(crate) fn merger_named<T>(linears: [T; 2]) -> impl Iterator<Item = (String, T)> {
    MERGER_LINEARS.map(str::to_owned).into_iter().zip(linears)
}

/// The checkpoint name of the patch embedding and of every linear's weight and bias (`linears`
/// by path), and beside them on the device their largest magnitudes: what
/// [`crate::models::VisionTower::cast_magnitudes`] returns.
pub(crate) fn cast_magnitudes<'a>(
    patch_embed_t: &Tensor<2>,
    linears: impl Iterator<Item = (String, &'a LoraLinear)>,
) -> (Vec<String>, Tensor<1>) {
    let mut names = vec!["patch_embed.proj.weight".to_owned()];
    let mut largest = vec![patch_embed_t.clone().abs().max()];
    for (path, linear) in linears {
        names.extend([format!("{path}.weight"), format!("{path}.bias")]);
        largest.push(linear.largest_magnitudes());
    }
    (names, Tensor::cat(largest, 0))
}

/// Each frame of each image, in rows: the segments full attention keeps apart.
pub(crate) fn frames(grids: &[[usize; 3]]) -> Vec<usize> {
    grids
        .iter()
        .flat_map(|&[t, h, w]| std::iter::repeat_n(h * w, t))
        .collect()
}

/// The pieces attention runs `segments` in, for `heads` heads of `head_dim`: the fused kernel
/// writes no scores out and takes every segment of one length together; Burn's attention
/// keeps its scores within `buffer_limit`.
pub(crate) fn attention_pieces(
    segments: &[usize],
    heads: usize,
    head_dim: usize,
    kernel: AttentionKernel,
    buffer_limit: u64,
) -> Vec<attention::Piece> {
    let limit = match kernel.writes_scores(head_dim) {
        true => buffer_limit,
        false => u64::MAX,
    };
    attention::pieces(segments, heads, limit)
}

/// One forward pass's way of running layers: with the model's kernels, each stage marked on
/// its clock.
pub(crate) struct Pass<'a> {
    /// The kernel each op runs with.
    pub kernels: Kernels,
    /// Where the stages are marked.
    pub stages: &'a StageClock,
}

impl Pass<'_> {
    /// `layer` on `x`: its base product marked as `stage`, its LoRA op (where adapters are
    /// installed) as [`Stage::LoraOp`]; both as `stage` where the layer's kernel adds the
    /// deltas as it stores its product ([`LoraLinear::fused`]).
    pub(crate) fn linear(
        &self,
        layer: &LoraLinear,
        x: Tensor<2>,
        batch: &LoraBatch,
        stage: Stage,
    ) -> Result<Tensor<2>, ModelError> {
        if let Some(y) = layer.fused(x.clone(), batch) {
            let y = y?;
            self.stages.mark(stage);
            return Ok(y);
        }
        let y = layer.base(x.clone());
        self.stages.mark(stage);
        if !layer.has_lora() {
            return Ok(y);
        }
        let y = layer.add_lora(x, y, batch)?;
        self.stages.mark(Stage::LoraOp);
        Ok(y)
    }

    /// Self-attention of `x` (`[rows, heads · head_dim]`) within the segments `pieces` cover:
    /// `qkv`, rotary by `rotary`'s tables, attention, `proj`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention(
        &self,
        qkv: &LoraLinear,
        proj: &LoraLinear,
        x: Tensor<2>,
        heads: usize,
        rotary: &rotary::Rotary,
        pieces: &[attention::Piece],
        tower: &LoraBatch,
    ) -> Result<Tensor<2>, ModelError> {
        let [rows, width] = x.dims();
        let hd = width / heads;
        let qkv = self
            .linear(qkv, x, tower, Stage::Qkv)?
            .reshape([rows, 3, heads, hd]);
        let [q_cos, q_sin] = &rotary.q;
        let [k_cos, k_sin] = &rotary.k;
        let q = rotate_packed(&qkv, 0, q_cos, q_sin, self.kernels.rotary);
        let k = rotate_packed(&qkv, 1, k_cos, k_sin, self.kernels.rotary);
        let v = qkv.slice([0..rows, 2..3]).reshape([rows, heads, hd]);
        self.stages.mark(Stage::Rotary);
        let outputs = pieces
            .iter()
            .map(|&piece| attention::attend(&q, &k, &v, piece, self.kernels.attention))
            .collect();
        let attended = Tensor::cat(outputs, 0);
        self.stages.mark(Stage::Attention);
        self.linear(proj, attended, tower, Stage::Proj)
    }

    /// `x + update`, marked as [`Stage::Residual`].
    pub(crate) fn residual(&self, x: Tensor<2>, update: Tensor<2>) -> Tensor<2> {
        let sum = x + update;
        self.stages.mark(Stage::Residual);
        sum
    }

    /// Marks the end of `stage`.
    pub(crate) fn mark(&self, stage: Stage) {
        self.stages.mark(stage);
    }
}
