//! Stacking the adapters of the GPU slots into the model's target linears.

use burn::tensor::{Device, Tensor, TensorData};

use super::{ModuleLora, PeftAdapter};
use crate::models::VisionTower;
use crate::ops::lora::LoraSlice;

/// Stacks the adapters in `slots` (slot `i` holds `slots[i]`, or nothing) into every target
/// linear of `model`. A layer no slotted adapter covers gets no LoRA at all; smaller ranks are
/// zero-padded to the largest rank among the adapters covering the layer.
pub fn install(model: &mut dyn VisionTower, slots: &[Option<&PeftAdapter>], device: &Device) {
    for target in model.lora_targets() {
        let covering: Vec<(usize, &ModuleLora)> = slots
            .iter()
            .enumerate()
            .filter_map(|(slot, adapter)| {
                Some((slot, adapter.as_ref()?.modules.get(&target.path)?))
            })
            .collect();
        let slice = (!covering.is_empty()).then(|| {
            let rank = covering.iter().map(|(_, m)| m.rank).max().unwrap_or(1);
            let (n, inp, out) = (slots.len(), target.in_features, target.out_features);
            let mut a = vec![0.0f32; n * rank * inp];
            let mut b = vec![0.0f32; n * out * rank];
            for (slot, module) in covering {
                // A: the adapter's rows on top, the rest zero.
                a[slot * rank * inp..][..module.rank * inp].copy_from_slice(&module.a);
                // B: the adapter's columns on the left of each row, the rest zero.
                for o in 0..out {
                    b[(slot * out + o) * rank..][..module.rank]
                        .copy_from_slice(&module.b[o * module.rank..(o + 1) * module.rank]);
                }
            }
            LoraSlice {
                a: Tensor::from_data(TensorData::new(a, [n, rank, inp]), device),
                b: Tensor::from_data(TensorData::new(b, [n, out, rank]), device),
                offset: 0,
            }
        });
        model
            .target_mut(&target.path)
            .expect("lora_targets lists the model's own layers")
            .set_lora(slice);
    }
}
