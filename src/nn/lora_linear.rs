//! A linear layer with per-row LoRA: `y = x·Wᵀ + b`, then each row's adapter delta.

use burn::tensor::{DType, Tensor};

use crate::ops::linear::LinearChoice;
use crate::ops::linear::{LinearKernel, materialize};
use crate::ops::lora::{FusedLinear, LoraBatch, LoraOpError, LoraSlice, fuse, fuses, lora_apply};

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
    /// [`Self::fused_where_it_fits`] fits, and, where the layer's kernel is timed per shape
    /// ([`LinearChoice::Timed`]), where the device ran it faster than the op apart on this
    /// shape ([`fusion`]). `None` where not: the caller runs [`Self::base`] and
    /// [`Self::add_lora`].
    pub fn fused(&self, x: Tensor<2>, batch: &LoraBatch) -> Option<Result<Tensor<2>, LoraOpError>> {
        let fused = match self.fuse(&x, batch)? {
            Ok(fused) => fused,
            Err(error) => return Some(Err(error)),
        };
        if matches!(self.kernel, LinearChoice::Timed(_)) && !fuses(&x, &fused).0 {
            return None;
        }
        Some(Ok(fused.run(x)))
    }

    /// `x·Wᵀ + b` with each row's adapter delta added in one pass over the output, wherever
    /// adapters are installed and the kernel picked for the shape is one of ours with a LoRA
    /// epilogue that takes the product and the batch
    /// ([`linear_lora`](crate::ops::lora::linear_lora)). `None` where not.
    pub fn fused_where_it_fits(
        &self,
        x: Tensor<2>,
        batch: &LoraBatch,
    ) -> Option<Result<Tensor<2>, LoraOpError>> {
        self.fuse(&x, batch)
            .map(|fused| fused.map(|fused| fused.run(x)))
    }

    /// The checked op fused into the kernel picked for `x`'s shape ([`fuse`]): `None` where
    /// it does not fit.
    fn fuse<'a>(
        &'a self,
        x: &Tensor<2>,
        batch: &'a LoraBatch,
    ) -> Option<Result<FusedLinear<'a>, LoraOpError>> {
        let (slice, bias) = (self.lora.as_ref()?, self.bias.as_ref()?);
        let shader = self.kernel.kernel(x, &self.weight_t, Some(bias)).shader()?;
        fuse(x, &self.weight_t, bias, slice, batch, shader).transpose()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::linear::LinearKernel;
    use crate::ops::lora::testing::fused_layer;
    use crate::runtime::device;

    /// A layer whose kernel is timed per shape runs the op fused or apart as the choice kept
    /// for its shape says; one with a named kernel runs it fused wherever it fits.
    #[test]
    fn a_timed_layer_fuses_as_its_shape_s_choice_says() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        // 24 rows round to 32, 40 to 64: two shapes no other test runs.
        for (rows, fuses) in [(24, false), (40, true)] {
            let (problem, data, weight_t, bias) = fused_layer([rows, 36, 60], (3, 8), DType::F32);
            let on = data.to_device(&gpu);
            let mut layer = LoraLinear::new(
                weight_t.transpose().to_device(&gpu.device),
                Some(bias.to_device(&gpu.device)),
            );
            layer.set_lora(Some(on.slices[0].clone()));
            layer.set_kernel(LinearChoice::Timed(&[LinearKernel::Tiled]));
            let batch = LoraBatch::new(problem.meta(), &gpu);
            let fused = layer.fuse(&on.x, &batch).unwrap().unwrap();
            crate::ops::lora::keep_for_tests(&on.x, &fused, fuses);

            let all_fused = layer
                .fused_where_it_fits(on.x.clone(), &batch)
                .unwrap()
                .unwrap();
            match layer.fused(on.x.clone(), &batch) {
                Some(y) => {
                    assert!(fuses, "{rows} rows: fused where apart was kept");
                    y.unwrap()
                        .into_data()
                        .assert_eq(&all_fused.into_data(), true);
                }
                None => assert!(!fuses, "{rows} rows: apart where fused was kept"),
            }
            layer.set_kernel(LinearChoice::Fixed(LinearKernel::Tiled));
            assert!(
                layer.fused(on.x.clone(), &batch).is_some(),
                "{rows} rows: a named kernel fuses"
            );
        }
    }
}
