//! Where a Qwen tower's weights come from: a Hugging Face checkpoint, or random values of the
//! same shapes (benchmarks, tests).

use std::path::Path;

use burn::tensor::{Device, Distribution, Tensor};

use crate::models::checkpoint::Checkpoint;
use crate::models::error::ModelError;
use crate::models::qwen_vision::LayerNorm;
use crate::nn::LoraLinear;

/// Where a tower's `build` gets its tensors, by checkpoint name without the `visual.` prefix.
pub(crate) trait WeightSource {
    /// The tensor `name` of `shape`.
    fn tensor<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
    ) -> Result<Tensor<D>, ModelError>;
}

/// The linear `name` (`[out, inp]` weight and its bias).
pub(crate) fn linear(
    weights: &mut impl WeightSource,
    name: &str,
    out: usize,
    inp: usize,
) -> Result<LoraLinear, ModelError> {
    let weight = weights.tensor(&format!("{name}.weight"), [out, inp])?;
    let bias = weights.tensor(&format!("{name}.bias"), [out])?;
    Ok(LoraLinear::new(weight, Some(bias)))
}

/// The layer norm `name` over `width` values.
pub(crate) fn layer_norm(
    weights: &mut impl WeightSource,
    name: &str,
    width: usize,
) -> Result<LayerNorm, ModelError> {
    Ok(LayerNorm {
        weight: weights.tensor(&format!("{name}.weight"), [width])?,
        bias: weights.tensor(&format!("{name}.bias"), [width])?,
    })
}

/// A Hugging Face checkpoint.
pub(crate) struct CheckpointWeights<'a> {
    ckpt: Checkpoint,
    prefix: &'static str,
    device: &'a Device,
}

impl<'a> CheckpointWeights<'a> {
    /// The checkpoint in `dir`, its tensors read onto `device`, `tensors` of them reported as
    /// the progress to make.
    pub(crate) fn open(dir: &Path, device: &'a Device, tensors: usize) -> Result<Self, ModelError> {
        let mut ckpt = Checkpoint::open(dir)?;
        // transformers 5's `model.visual.`, 4's `visual.`, or none for the tower saved alone;
        // with none of them, the missing weights are named as transformers 4 spells them.
        let prefix = ["model.visual.", "visual.", ""]
            .into_iter()
            .find(|prefix| ckpt.has_prefix(&format!("{prefix}blocks.")))
            .unwrap_or("visual.");
        ckpt.report_progress(tensors as u64);
        Ok(Self {
            ckpt,
            prefix,
            device,
        })
    }
}

impl WeightSource for CheckpointWeights<'_> {
    fn tensor<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
    ) -> Result<Tensor<D>, ModelError> {
        let key = format!("{}{name}", self.prefix);
        Ok(self.ckpt.tensor(&key, shape, self.device)?)
    }
}

/// Random weights: linears uniform in ±1/√fan-in (the conv's fan-in is its patch length),
/// biases in ±0.02, norms within 0.1 of identity.
pub(crate) struct RandomWeights<'a> {
    /// Where the tensors are made.
    pub device: &'a Device,
}

impl WeightSource for RandomWeights<'_> {
    fn tensor<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
    ) -> Result<Tensor<D>, ModelError> {
        let norm = name.contains("norm") || name.contains("ln_q");
        let range = match (norm, D) {
            (true, _) => 0.1,
            (false, 1) => 0.02,
            (false, _) => 1.0 / (shape[1..].iter().product::<usize>() as f64).sqrt(),
        };
        let values = Tensor::<D>::random(shape, Distribution::Uniform(-range, range), self.device);
        Ok(if norm && name.ends_with(".weight") {
            values + 1.0
        } else {
            values
        })
    }
}
