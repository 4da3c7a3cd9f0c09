//! A linear layer with per-row LoRA: `y = x·Wᵀ + b`, then each row's adapter delta.

use burn::tensor::{DType, Tensor};

use super::ops::{LoraBatch, LoraOpError, LoraSlice, linear_lora, lora_apply};
use crate::model::gemm::{LinearKernel, materialize};
use crate::model::linear_choice::LinearChoice;

/// A base linear plus the adapters stacked in its slots (none until adapters are activated).
#[derive(Debug, Clone)]
pub struct LoraLinear {
    /// `Wᵀ`: `[in, out]`.
    weight_t: Tensor<2>,
    /// `[out]`.
    bias: Option<Tensor<1>>,
    /// The stacked adapters, one slice covering the whole output (packed `qkv` included).
    lora: Option<LoraSlice>,
    /// Which kernel computes `x·Wᵀ + b` (Burn's until [`Self::set_kernel`]).
    kernel: LinearChoice,
}

impl LoraLinear {
    /// A layer from a checkpoint's `weight` (`[out, in]`) and `bias`. `Wᵀ` is laid out row by
    /// row once here (on a GPU; both linear kernels read it so).
    pub fn new(weight: Tensor<2>, bias: Option<Tensor<1>>) -> Self {
        Self {
            weight_t: materialize(weight.transpose()),
            bias,
            lora: None,
            kernel: LinearChoice::Fixed(LinearKernel::Burn),
        }
    }

    /// `(in, out)`.
    pub fn dims(&self) -> (usize, usize) {
        let [input, output] = self.weight_t.dims();
        (input, output)
    }

    /// The layer with its weights (and any installed adapters) in `dtype`.
    pub fn cast(self, dtype: DType) -> Self {
        Self {
            weight_t: self.weight_t.cast(dtype),
            bias: self.bias.map(|b| b.cast(dtype)),
            lora: self.lora.map(|slice| cast_slice(slice, dtype)),
            kernel: self.kernel,
        }
    }

    /// Computes `x·Wᵀ + b` with the kernel `kernel` picks.
    pub fn set_kernel(&mut self, kernel: LinearChoice) {
        self.kernel = kernel;
    }

    /// Installs the stacked adapter weights (`None`: no adapter in any slot), in the layer's
    /// dtype.
    pub fn set_lora(&mut self, lora: Option<LoraSlice>) {
        let dtype = self.weight_t.dtype();
        self.lora = lora.map(|slice| cast_slice(slice, dtype));
    }

    /// The base product on `x` (`[rows, in]`), `x·Wᵀ + b`; [`Self::add_lora`] adds the
    /// adapters' deltas (two calls, so a profile can time them apart).
    pub fn base(&self, x: Tensor<2>) -> Tensor<2> {
        self.kernel.linear(x, &self.weight_t, self.bias.as_ref())
    }

    /// `y`, the base product of `x`, with each row's delta of the adapter of its slot in
    /// `batch` added, where adapters are installed.
    pub fn add_lora(
        &self,
        x: Tensor<2>,
        y: Tensor<2>,
        batch: &LoraBatch,
    ) -> Result<Tensor<2>, LoraOpError> {
        match &self.lora {
            Some(slice) => lora_apply(x, y, std::slice::from_ref(slice), batch),
            None => Ok(y),
        }
    }

    /// The largest magnitude in `W` and in `b` (0 without a bias): a `[2]` tensor on the
    /// layer's device, so a check of many layers reads back once.
    pub fn largest_magnitudes(&self) -> Tensor<1> {
        let weight = self.weight_t.clone().abs().max();
        let bias = match &self.bias {
            Some(bias) => bias.clone().abs().max(),
            None => weight.zeros_like(),
        };
        Tensor::cat(vec![weight, bias], 0)
    }

    /// `x·Wᵀ + b` with each row's adapter delta added in one pass over the output: where
    /// adapters are installed and the kernel picked for the shape is one of ours with a LoRA
    /// epilogue that takes the product and the batch ([`linear_lora`]). `None` where not: the
    /// caller runs [`Self::base`] and [`Self::add_lora`].
    pub fn fused(&self, x: Tensor<2>, batch: &LoraBatch) -> Option<Result<Tensor<2>, LoraOpError>> {
        let (slice, bias) = (self.lora.as_ref()?, self.bias.as_ref()?);
        let kernel = self.kernel.kernel(&x, &self.weight_t, Some(bias));
        linear_lora(x, &self.weight_t, bias, slice, batch, kernel.shader()?)
    }

    /// Whether adapter weights are installed.
    pub fn has_lora(&self) -> bool {
        self.lora.is_some()
    }
}

fn cast_slice(slice: LoraSlice, dtype: DType) -> LoraSlice {
    if slice.a.dtype() == dtype && slice.b.dtype() == dtype {
        return slice;
    }
    LoraSlice {
        a: slice.a.cast(dtype),
        b: slice.b.cast(dtype),
        offset: slice.offset,
    }
}
