//! Three rows, three different adapters (one of them "none"), one LoRA op call.
//!
//! `cargo run --release --example mixed_batch`

use burn::tensor::Tensor;
use mmlora::ops::lora::{LoraBatch, LoraSlice, lora_apply};
use mmlora::routing::mapping::{LoraMapping, LoraMappingKind};
use mmlora::routing::meta::{KernelMeta, NO_SLOT, SlotTable};
use mmlora::runtime::device;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let on = device::gpu().unwrap_or_else(|_| device::cpu());
    println!("device: {}", on.description);

    // Adapter ids per row as the mapping builder would emit them (0 = no adapter) …
    let mapping = LoraMapping {
        kind: LoraMappingKind::Tower,
        index_mapping: vec![7, 0, 3],
        prompt_mapping: vec![7, 0, 3],
        is_prefill: true,
    };
    // … resolved to slots: adapter 7 in slot 0, adapter 3 in slot 1.
    let table = SlotTable::for_adapters([7, 3], 2)?;
    let meta = KernelMeta::from_mapping(&mapping, &table)?;
    assert_eq!(meta.token_slots(), &[0, NO_SLOT, 1]);
    let batch = LoraBatch::new(meta, &on);

    // A 4 → 2 layer; slot 0 adds x₀ to output 0, slot 1 adds 2·x₁ to output 1 (rank 1).
    let d = &on.device;
    let x = Tensor::<2>::from_floats([[1.0, 2.0, 3.0, 4.0]; 3], d);
    let base = Tensor::<2>::zeros([3, 2], d);
    let adapters = LoraSlice {
        a: Tensor::from_floats([[[1.0, 0.0, 0.0, 0.0]], [[0.0, 1.0, 0.0, 0.0]]], d),
        b: Tensor::from_floats([[[1.0], [0.0]], [[0.0], [2.0]]], d),
        offset: 0,
    };
    let y = lora_apply(x, base, &[adapters], &batch)?;
    println!("{}", y.clone().into_data());
    y.into_data().assert_eq(
        &Tensor::<2>::from_floats([[1.0, 0.0], [0.0, 0.0], [0.0, 4.0]], d).into_data(),
        true,
    );
    Ok(())
}
