//! Whether a layer's LoRA op runs fused into its base product, on a GPU where the linears'
//! kernels are timed per shape: the faster of the two ways on the device, chosen by the
//! runtime's one tuner ([`crate::runtime::tuner`]), each way's output checked first.
//!
//! Fused ([`FusedLinear::run`]), the linear kernel's epilogue adds each row's delta as it
//! stores the row, which saves the expand's launch and its pass over the output; but it loads
//! `B[slot]` for every four rows it stores (every row, where they mix slots), where the expand
//! loads it once per tile of 16 rows. Which costs more hangs on the GPU and the shape. The two
//! ways differ by a few percent of a call, less than a sync's jitter on a fast GPU, so each
//! timed run is [`BACK_TO_BACK_CALLS`] calls back to back. The choices are kept per device,
//! dtype, linear shader and shape: rows rounded up to a power of two, the input and output
//! widths and the rank. The ways round the delta into the output once (fused) or twice
//! (apart), so where the choice differs the output's last bits may too.

use burn::backend::{Device as _, DeviceId};
use burn::tensor::{DType, Tensor};

use super::{FusedLinear, composed};
use crate::ops::linear::LinearShader;
use crate::ops::linear::timed_reference;
use crate::runtime::tuner::{self, Reference, Timing, Trial, Tuner};

/// A shape choices are kept for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ShapeKey {
    device: DeviceId,
    dtype: DType,
    shader: LinearShader,
    /// Rows rounded up to a power of two.
    rows: usize,
    in_features: usize,
    out_features: usize,
    rank: usize,
}

impl ShapeKey {
    /// The shape of `fused`'s op on `x`.
    fn new(x: &Tensor<2>, fused: &FusedLinear<'_>) -> Self {
        let [rows, in_features] = x.dims();
        let [_, out_features] = fused.weight_t.dims();
        ShapeKey {
            device: x.device().as_dispatch().to_id(),
            dtype: x.dtype(),
            shader: fused.shader,
            rows: rows.next_power_of_two(),
            in_features,
            out_features,
            rank: fused.slice.b.dims()[2],
        }
    }
}

/// The two ways a layer's op runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::IntoStaticStr)]
#[strum(serialize_all = "kebab-case")]
pub enum Way {
    /// In the linear kernel's store ([`FusedLinear::run`]).
    Fused,
    /// After the product ([`FusedLinear::apart`]).
    Apart,
}

/// Calls of each way per timed run, back to back between two device syncs.
pub const BACK_TO_BACK_CALLS: usize = 4;

static TUNER: Tuner<ShapeKey, Way> = Tuner::new("LoRA op fused or apart");

/// Whether `fused`'s op runs fused on `x` (the input [`fuse`](super::fuse) checked), with the
/// two ways' timings when this call made them (`None`: the choice was kept from an earlier
/// call, or nothing was timed).
pub fn fuses(x: &Tensor<2>, fused: &FusedLinear<'_>) -> (bool, Option<Vec<Timing<Way>>>) {
    let run = |way| match way {
        Way::Fused => fused.run(x.clone()),
        Way::Apart => fused.apart(x.clone()),
    };
    let trial = Trial {
        candidates: &[Way::Fused, Way::Apart],
        fallback: Way::Fused,
        calls: BACK_TO_BACK_CALLS,
        run: &run,
    };
    let (way, timings) = TUNER.pick(ShapeKey::new(x, fused), &x.device(), &trial, || {
        reference(x, fused)
    });
    (way == Way::Fused, timings)
}

/// The layer's output composed in f32: the linear's reference product
/// ([`timed_reference`]) with the op's composed delta added ([`composed::reference`]), their
/// bounds summed, plus one rounding of the product to the output's dtype, which the op apart
/// stores before it adds the delta.
fn reference(x: &Tensor<2>, fused: &FusedLinear<'_>) -> Result<Option<Reference>, String> {
    let Some(product) = timed_reference(x, fused.weight_t, Some(fused.bias))? else {
        return Ok(None);
    };
    let slices = std::slice::from_ref(fused.slice);
    let Some(op) = composed::reference(x, &product.output, slices, fused.batch.meta())? else {
        return Ok(None);
    };
    let stored = product.output.abs() * tuner::unit_roundoff(x.dtype());
    let bound = product.bound + op.bound + stored;
    Reference::new(op.output, bound, x.dtype())
}

/// Keeps `fuses` for the shape of `fused`'s op on `x`, as if timing had found it.
#[cfg(test)]
pub(crate) fn keep_for_tests(x: &Tensor<2>, fused: &FusedLinear<'_>, fuses: bool) {
    let way = if fuses { Way::Fused } else { Way::Apart };
    TUNER.keep(ShapeKey::new(x, fused), way);
}

#[cfg(test)]
mod tests {
    use burn::tensor::DType;

    use super::super::testing::fused_layer;
    use super::super::{LoraBatch, fuse};
    use super::*;
    use crate::runtime::device;

    /// `fuses` on a fresh random layer of `rows` rows, in a shape no other test runs, whose op
    /// `tiled` takes fused.
    fn fuses_on(rows: usize, gpu: &device::RuntimeDevice) -> (bool, Option<Vec<Timing<Way>>>) {
        let (problem, data, weight_t, bias) = fused_layer([rows, 44, 52], (3, 4), DType::F32);
        let on = data.to_device(gpu);
        let (weight_t, bias) = (weight_t.to_device(&gpu.device), bias.to_device(&gpu.device));
        let batch = LoraBatch::new(problem.meta(), gpu);
        let shader = LinearShader::Tiled;
        let fused = fuse(&on.x, &weight_t, &bias, &on.slices[0], &batch, shader)
            .unwrap()
            .expect("tiled takes the op fused");
        fuses(&on.x, &fused)
    }

    #[test]
    fn a_shape_is_timed_once_and_its_choice_kept() {
        let Some(gpu) = device::gpu_for_tests() else {
            return;
        };
        let (first, times) = fuses_on(40, &gpu);
        let times = times.expect("the shape's first call times both ways");
        assert!(times.iter().all(|t| t.outcome.is_ok()), "{times:?}");
        // 40 rows round to 64, 100 to 128: another shape, timed anew.
        assert!(fuses_on(100, &gpu).1.is_some());
        // 64 rows round to 64: the choice is kept, nothing timed.
        assert_eq!(fuses_on(64, &gpu), (first, None));
    }
}
