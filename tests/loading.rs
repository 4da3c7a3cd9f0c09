//! Checkpoint and adapter layouts that must load (bf16 shards, language-model shards never read,
//! the older single-file `visual.*` layout) and the rank limit. Inputs that must be refused are
//! the corpus in `tests/corpus.rs`.

mod common;

use std::fs;
use std::path::Path;

use burn::tensor::{Distribution, Tensor};
use common::{copy_dir, fixture_dir, keep, rewrite_safetensors};
use mmlora::adapters::PeftAdapter;
use mmlora::device;
use mmlora::lora::meta::{KernelMeta, NO_SLOT};
use mmlora::lora::ops::LoraBatch;
use mmlora::model::qwen2_vl::{ModelError, Qwen2VlVision};
use safetensors::{Dtype, SafeTensors};
use tempfile::TempDir;

fn load_model(dir: &Path) -> Result<Qwen2VlVision, ModelError> {
    Qwen2VlVision::load(dir, &device::cpu().device)
}

#[test]
fn language_model_shards_are_never_read_and_bf16_weights_load() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    copy_dir(&fixture_dir(), dir);
    // A language-model-only shard that is not even valid safetensors: reading it would fail.
    fs::write(dir.join("model-lm.safetensors"), b"never read").unwrap();
    let index_path = dir.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"]["model.language_model.layers.0.mlp.up_proj.weight"] =
        "model-lm.safetensors".into();
    fs::write(&index_path, index.to_string()).unwrap();
    // The blocks' shard in bf16.
    rewrite_safetensors(
        &dir.join("model-00001-of-00002.safetensors"),
        |n, d, s, b| {
            assert_eq!(d, Dtype::F32);
            let halves = b
                .chunks_exact(4)
                .flat_map(|c| {
                    half::bf16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes()
                })
                .collect();
            vec![(n.to_owned(), Dtype::BF16, s.to_vec(), halves)]
        },
    );
    let model = load_model(dir).unwrap();
    assert_eq!(model.lora_targets().len(), 2 * 4 + 2);
}

#[test]
fn ranks_above_max_rank_are_refused() {
    let model = load_model(&fixture_dir()).unwrap();
    let dir = fixture_dir().join("adapters/rslora-r8");
    let error = PeftAdapter::load("rslora-r8", &dir, &model.lora_targets(), 4).unwrap_err();
    assert!(error.to_string().contains("max_rank 4"), "{error}");
    assert!(PeftAdapter::load("rslora-r8", &dir, &model.lora_targets(), 8).is_ok());
}

#[test]
fn a_single_file_checkpoint_with_the_old_prefix_loads_the_same_model() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    fs::copy(fixture_dir().join("config.json"), dir.join("config.json")).unwrap();
    // Merge both shards into one `model.safetensors` with keys `visual.*` (older transformers).
    let single = dir.join("model.safetensors");
    fs::copy(
        fixture_dir().join("model-00001-of-00002.safetensors"),
        &single,
    )
    .unwrap();
    let rest = fs::read(fixture_dir().join("model-00002-of-00002.safetensors")).unwrap();
    let rest = SafeTensors::deserialize(&rest).unwrap();
    let extra: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = rest
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let first = std::cell::Cell::new(true);
    rewrite_safetensors(&single, |n, d, s, b| {
        let mut out = keep(&n.replacen("model.visual.", "visual.", 1), d, s, b);
        if first.replace(false) {
            out.extend(extra.iter().map(|(n, d, s, b)| {
                (
                    n.replacen("model.visual.", "visual.", 1),
                    *d,
                    s.clone(),
                    b.clone(),
                )
            }));
        }
        out
    });
    let old = load_model(dir).unwrap();
    let new = load_model(&fixture_dir()).unwrap();
    let cpu = device::cpu();
    let x = Tensor::<2>::random([16, 1176], Distribution::Default, &cpu.device);
    let none = |n| {
        LoraBatch::new(
            KernelMeta::from_token_slots(vec![NO_SLOT; n], 1).unwrap(),
            &cpu,
        )
    };
    let run = |m: &Qwen2VlVision| {
        m.forward(x.clone(), &[[1, 4, 4]], &none(16), &none(4))
            .unwrap()
            .embeds
            .into_data()
    };
    run(&old).assert_eq(&run(&new), true);
}
