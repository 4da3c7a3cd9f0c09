//! Checkpoint and adapter layouts that must load (bf16, f16 and f64 shards, language-model
//! shards never read, the older single-file `visual.*` layout, a single file beside a stale
//! index) and the rank limit. Inputs that must be refused are
//! the corpus in `tests/corpus.rs`.

mod common;

use std::fs;
use std::path::Path;

use burn::tensor::{Tensor, TensorData};
use common::{copy_dir, fixture_dir, keep, rewrite_safetensors};
use mmlora::adapters::PeftAdapter;
use mmlora::models::qwen2_vl::Qwen2VlVision;
use mmlora::models::{ModelError, VisionTower};
use mmlora::ops::lora::LoraBatch;
use mmlora::routing::meta::{KernelMeta, NO_SLOT};
use mmlora::runtime::device;
use safetensors::{Dtype, SafeTensors};
use tempfile::TempDir;

fn load_model(dir: &Path) -> Result<Qwen2VlVision, ModelError> {
    Qwen2VlVision::load(dir, &device::cpu().device)
}

/// The embeddings of `model` for a fixed input without adapters.
fn embeds_of(model: &Qwen2VlVision) -> TensorData {
    let cpu = device::cpu();
    let values = (0..16 * 1176).map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0);
    let x = Tensor::<2>::from_data(TensorData::new(values.collect(), [16, 1176]), &cpu.device);
    let none = |n| {
        LoraBatch::new(
            KernelMeta::from_token_slots(vec![NO_SLOT; n], 1).unwrap(),
            &cpu,
        )
    };
    model
        .forward(x, &[[1, 4, 4]], &none(16), &none(4))
        .unwrap()
        .embeds
        .into_data()
}

#[test]
fn language_model_shards_are_never_read() {
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
    embeds_of(&load_model(dir).unwrap())
        .assert_eq(&embeds_of(&load_model(&fixture_dir()).unwrap()), true);
}

/// Weights stored as bf16, f16 or f64 load as the same values stored as f32 (rounded to the
/// stored type first): widening to f32 is exact, and so is narrowing an f64 that holds an f32.
#[test]
fn weights_of_every_float_type_load_to_their_values() {
    let f32s = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    type Store = fn(&[f32]) -> (Vec<f32>, Dtype, Vec<u8>);
    let stores: [(&str, Store); 3] = [
        ("bf16", |v| {
            let h: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let bytes = h.iter().flat_map(|x| x.to_le_bytes()).collect();
            (h.iter().map(|x| x.to_f32()).collect(), Dtype::BF16, bytes)
        }),
        ("f16", |v| {
            let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
            let bytes = h.iter().flat_map(|x| x.to_le_bytes()).collect();
            (h.iter().map(|x| x.to_f32()).collect(), Dtype::F16, bytes)
        }),
        ("f64", |v| {
            let bytes = v.iter().flat_map(|&x| f64::from(x).to_le_bytes()).collect();
            (v.to_vec(), Dtype::F64, bytes)
        }),
    ];
    for (name, store) in stores {
        let [as_f32, as_stored] = [TempDir::new().unwrap(), TempDir::new().unwrap()];
        for (dir, stored) in [(&as_f32, false), (&as_stored, true)] {
            copy_dir(&fixture_dir(), dir.path());
            rewrite_safetensors(
                &dir.path().join("model-00001-of-00002.safetensors"),
                |n, d, s, b| {
                    assert_eq!(d, Dtype::F32);
                    let (rounded, dtype, bytes) = store(&f32s(b));
                    let (dtype, bytes) = match stored {
                        true => (dtype, bytes),
                        false => (
                            Dtype::F32,
                            rounded.iter().flat_map(|x| x.to_le_bytes()).collect(),
                        ),
                    };
                    vec![(n.to_owned(), dtype, s.to_vec(), bytes)]
                },
            );
        }
        let [expected, actual] =
            [&as_f32, &as_stored].map(|d| embeds_of(&load_model(d.path()).unwrap()));
        // Bitwise: the same f32 weights, the same kernels.
        actual.assert_eq(&expected, true);
        eprintln!("{name} weights load to their values");
    }
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
    embeds_of(&old).assert_eq(&embeds_of(&load_model(&fixture_dir()).unwrap()), true);

    // Beside an index whose shards cannot be read, the single file is the checkpoint, as in
    // transformers (a folder saved again unsharded keeps its old index).
    for name in [
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
    ] {
        fs::copy(fixture_dir().join(name), dir.join(name)).unwrap();
    }
    fs::write(dir.join("model-00001-of-00002.safetensors"), b"stale").unwrap();
    embeds_of(&load_model(dir).unwrap()).assert_eq(&embeds_of(&old), true);
}

/// `Qwen2VisionTransformerPretrainedModel.save_pretrained`: the tower alone, its config's
/// fields at the top (`model_type` `qwen2_vl_vision`) and its weights without a prefix.
#[test]
fn a_tower_saved_alone_loads_the_same_model() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    let config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(fixture_dir().join("config.json")).unwrap())
            .unwrap();
    let mut alone = config["vision_config"].clone();
    alone["model_type"] = "qwen2_vl_vision".into();
    fs::write(dir.join("config.json"), alone.to_string()).unwrap();
    for shard in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        fs::copy(fixture_dir().join(shard), dir.join(shard)).unwrap();
        rewrite_safetensors(&dir.join(shard), |n, d, s, b| {
            match n.strip_prefix("model.visual.") {
                Some(own) => keep(own, d, s, b),
                None => Vec::new(), // the language model's tensor: not the tower's
            }
        });
    }
    let index = fs::read_to_string(fixture_dir().join("model.safetensors.index.json")).unwrap();
    let index = index.replace("model.visual.", "");
    fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
    let tower = load_model(dir).unwrap();
    embeds_of(&tower).assert_eq(&embeds_of(&load_model(&fixture_dir()).unwrap()), true);
}
