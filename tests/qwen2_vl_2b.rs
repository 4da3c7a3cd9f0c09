//! A Qwen2-VL-2B-size vision tower (random bf16 weights in the real key layout) loads and runs
//! one 224×224 image on the CPU backend. Manual: `cargo test --release --test qwen2_vl_2b --
//! --ignored --nocapture` (writes a 1.3 GB checkpoint to a temporary folder).

mod common;

use std::time::Instant;

use burn::tensor::{Distribution, Tensor};
use common::{OwnedTensor, write_safetensors};
use mmlora::models::VisionTower;
use mmlora::models::qwen2_vl::Qwen2VlVision;
use mmlora::ops::lora::LoraBatch;
use mmlora::routing::meta::{KernelMeta, NO_SLOT};
use mmlora::runtime::device;
use safetensors::Dtype;

/// Qwen2-VL-2B's vision config (hub spelling).
const CONFIG: &str = r#"{"model_type": "qwen2_vl", "vision_config": {"depth": 32, "embed_dim": 1280,
  "mlp_ratio": 4, "num_heads": 16, "in_chans": 3, "hidden_size": 1536, "patch_size": 14,
  "spatial_merge_size": 2, "spatial_patch_size": 14, "temporal_patch_size": 2}}"#;

/// Uniform values in ±`scale`, as bf16 bytes, from a fixed-seed xorshift.
fn random(shape: &[usize], scale: f32, seed: &mut u64) -> OwnedTensor {
    let n: usize = shape.iter().product();
    let mut bytes = Vec::with_capacity(n * 2);
    for _ in 0..n {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        let unit = (*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        bytes.extend(half::bf16::from_f32(unit * scale).to_le_bytes());
    }
    OwnedTensor(Dtype::BF16, shape.to_vec(), bytes)
}

#[test]
#[ignore = "manual: writes and loads a 1.3 GB checkpoint"]
fn qwen2_vl_2b_vision_tower_runs_one_image_on_cpu() {
    let dir = tempfile::TempDir::new().unwrap();
    std::fs::write(dir.path().join("config.json"), CONFIG).unwrap();
    let (d, mlp, merged, hidden) = (1280, 5120, 5120, 1536);
    let mut seed = 0x2b2b_2b2b_u64;
    let mut tensors: Vec<(String, OwnedTensor)> = vec![(
        "model.visual.patch_embed.proj.weight".to_owned(),
        random(&[d, 3, 2, 14, 14], 0.03, &mut seed),
    )];
    let linear = |name: String, out: usize, inp: usize, seed: &mut u64| {
        let scale = 1.0 / (inp as f32).sqrt();
        [
            (format!("{name}.weight"), random(&[out, inp], scale, seed)),
            (format!("{name}.bias"), random(&[out], 0.1, seed)),
        ]
    };
    for i in 0..32 {
        let b = format!("model.visual.blocks.{i}");
        for (name, out, inp) in [
            ("attn.qkv", 3 * d, d),
            ("attn.proj", d, d),
            ("mlp.fc1", mlp, d),
            ("mlp.fc2", d, mlp),
        ] {
            tensors.extend(linear(format!("{b}.{name}"), out, inp, &mut seed));
        }
        for norm in ["norm1", "norm2"] {
            tensors.push((format!("{b}.{norm}.weight"), random(&[d], 1.0, &mut seed)));
            tensors.push((format!("{b}.{norm}.bias"), random(&[d], 0.1, &mut seed)));
        }
    }
    tensors.extend(linear(
        "model.visual.merger.mlp.0".into(),
        merged,
        merged,
        &mut seed,
    ));
    tensors.extend(linear(
        "model.visual.merger.mlp.2".into(),
        hidden,
        merged,
        &mut seed,
    ));
    tensors.push((
        "model.visual.merger.ln_q.weight".into(),
        random(&[d], 1.0, &mut seed),
    ));
    tensors.push((
        "model.visual.merger.ln_q.bias".into(),
        random(&[d], 0.1, &mut seed),
    ));
    write_safetensors(&dir.path().join("model.safetensors"), &tensors);
    drop(tensors);

    let cpu = device::cpu();
    let start = Instant::now();
    let model = Qwen2VlVision::load(dir.path(), &cpu.device).unwrap();
    let loaded = start.elapsed();

    // One 224×224 image: a 16×16 grid of patches.
    let rows = 16 * 16;
    let pixels = Tensor::<2>::random([rows, 1176], Distribution::Normal(0.0, 1.0), &cpu.device);
    let none = |n| {
        LoraBatch::new(
            KernelMeta::from_token_slots(vec![NO_SLOT; n], 1).unwrap(),
            &cpu,
        )
    };
    let start = Instant::now();
    let out = model
        .forward(pixels, &[[1, 16, 16]], &none(rows), &none(rows / 4))
        .unwrap();
    let embeds = out.embeds.into_data().try_to_vec::<f32>().unwrap();
    let ran = start.elapsed();
    assert_eq!(embeds.len(), 64 * hidden);
    assert!(embeds.iter().all(|v| v.is_finite()));
    eprintln!(
        "Qwen2-VL-2B vision tower (bf16 on disk, f32 compute): loaded in {:.1} s, one 224×224 image in {:.2} s on {}",
        loaded.as_secs_f64(),
        ran.as_secs_f64(),
        cpu.description
    );
}
