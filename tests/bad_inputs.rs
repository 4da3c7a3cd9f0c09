//! Checkpoints and adapters that cannot be honoured give typed errors naming the file, key or
//! adapter — never a panic or a wrong answer.

mod common;

use std::fs;
use std::path::Path;

use burn::tensor::{Distribution, Tensor};
use common::fixture_dir;
use mmlora::adapters::{AdapterError, PeftAdapter};
use mmlora::device;
use mmlora::lora::meta::{KernelMeta, NO_SLOT};
use mmlora::lora::ops::LoraBatch;
use mmlora::model::checkpoint::CheckpointError;
use mmlora::model::qwen2_vl::{ModelError, Qwen2VlVision};
use safetensors::{Dtype, SafeTensors, View, serialize};
use tempfile::TempDir;

/// A copy of the fixture model folder (or one adapter of it) to break.
fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// Rewrites the safetensors file at `path` through `edit(name, dtype, shape, bytes)`, which
/// returns the tensors to write instead (none to drop one).
fn rewrite(
    path: &Path,
    edit: impl Fn(&str, Dtype, &[usize], &[u8]) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
) {
    struct Owned(Dtype, Vec<usize>, Vec<u8>);
    impl View for &Owned {
        fn dtype(&self) -> Dtype {
            self.0
        }
        fn shape(&self) -> &[usize] {
            &self.1
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            (&self.2[..]).into()
        }
        fn data_len(&self) -> usize {
            self.2.len()
        }
    }
    let bytes = fs::read(path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors = Vec::new();
    for (name, view) in file.tensors() {
        for (n, d, s, b) in edit(&name, view.dtype(), view.shape(), view.data()) {
            tensors.push((n, Owned(d, s, b)));
        }
    }
    let refs: Vec<(String, &Owned)> = tensors.iter().map(|(n, o)| (n.clone(), o)).collect();
    fs::write(path, serialize(refs, None).unwrap()).unwrap();
}

fn keep(name: &str, d: Dtype, s: &[usize], b: &[u8]) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    vec![(name.to_owned(), d, s.to_vec(), b.to_vec())]
}

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
    rewrite(
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
fn missing_and_misshaped_tensors_name_the_key_and_file() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    copy_dir(&fixture_dir(), dir);
    let shard = dir.join("model-00002-of-00002.safetensors");
    rewrite(&shard, |n, d, s, b| {
        if n == "model.visual.merger.mlp.2.bias" {
            vec![(n.to_owned(), d, vec![s[0] - 1], b[..b.len() - 4].to_vec())]
        } else {
            keep(n, d, s, b)
        }
    });
    match load_model(dir) {
        Err(ModelError::Checkpoint(CheckpointError::Mismatch { key, path, .. })) => {
            assert_eq!(key, "model.visual.merger.mlp.2.bias");
            assert_eq!(path, shard);
        }
        other => panic!("expected a shape mismatch, got {other:?}"),
    }
    rewrite(&shard, |n, d, s, b| {
        if n.starts_with("model.visual.merger.ln_q.weight") {
            vec![]
        } else {
            keep(n, d, s, b)
        }
    });
    // The index still names the key, but the shard lacks it.
    let error = load_model(dir).unwrap_err().to_string();
    assert!(error.contains("merger"), "{error}");
}

#[test]
fn broken_model_folders_are_typed_errors() {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path();
    assert!(matches!(load_model(dir), Err(ModelError::Config(_))));
    copy_dir(&fixture_dir(), dir);
    fs::remove_file(dir.join("model.safetensors.index.json")).unwrap();
    assert!(matches!(
        load_model(dir),
        Err(ModelError::Checkpoint(CheckpointError::NoWeights { .. }))
    ));
    let config = fs::read_to_string(fixture_dir().join("config.json")).unwrap();
    fs::write(dir.join("config.json"), config.replace("qwen2_vl", "llava")).unwrap();
    let error = load_model(dir).unwrap_err().to_string();
    assert!(
        error.contains("config.json") && error.contains("llava"),
        "{error}"
    );
    fs::write(dir.join("model.safetensors"), b"not safetensors").unwrap();
    fs::write(dir.join("config.json"), config).unwrap();
    let error = load_model(dir).unwrap_err().to_string();
    assert!(error.contains("model.safetensors"), "{error}");
}

/// Loads fixture adapter `name` after `breaking` its folder.
fn broken_adapter(name: &str, breaking: impl FnOnce(&Path)) -> AdapterError {
    let tmp = TempDir::new().unwrap();
    let dir = tmp.path().join(name);
    copy_dir(&fixture_dir().join("adapters").join(name), &dir);
    breaking(&dir);
    let model = load_model(&fixture_dir()).unwrap();
    PeftAdapter::load(name, &dir, &model.lora_targets(), 64).unwrap_err()
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("adapter_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    fs::write(path, config.to_string()).unwrap();
}

#[test]
fn adapters_that_cannot_be_honoured_name_the_adapter_and_key() {
    let dora = broken_adapter("all-r4", |d| {
        edit_config(d, |c| c["use_dora"] = true.into())
    });
    assert!(
        dora.to_string().contains("all-r4") && dora.to_string().contains("DoRA"),
        "{dora}"
    );

    let saved = broken_adapter("all-r4", |d| {
        edit_config(d, |c| c["modules_to_save"] = serde_json::json!(["merger"]))
    });
    assert!(matches!(saved, AdapterError::Unsupported { .. }), "{saved}");

    let bias = broken_adapter("all-r4", |d| edit_config(d, |c| c["bias"] = "all".into()));
    assert!(bias.to_string().contains("bias"), "{bias}");

    let rank = broken_adapter("rslora-r8", |d| {
        // Claims rank 4 while the tensors hold rank 8: a shape mismatch on a named key.
        edit_config(d, |c| c["r"] = 4.into())
    });
    match rank {
        AdapterError::Incompatible { adapter, key, .. } => {
            assert_eq!(adapter, "rslora-r8");
            assert!(key.ends_with(".lora_A.weight"), "{key}");
        }
        other => panic!("{other}"),
    }

    let unknown = broken_adapter("tower-r2", |d| {
        rewrite(&d.join("adapter_model.safetensors"), |n, dt, s, b| {
            vec![(n.replace("mlp.fc1", "mlp.fc9"), dt, s.to_vec(), b.to_vec())]
        })
    });
    assert!(unknown.to_string().contains("mlp.fc9"), "{unknown}");

    let orphan = broken_adapter("tower-r2", |d| {
        rewrite(&d.join("adapter_model.safetensors"), |n, dt, s, b| {
            if n.contains("blocks.0.mlp.fc1.lora_B") {
                vec![]
            } else {
                keep(n, dt, s, b)
            }
        })
    });
    assert!(orphan.to_string().contains("partner"), "{orphan}");

    let missing = broken_adapter("tower-r2", |d| {
        fs::remove_file(d.join("adapter_model.safetensors")).unwrap()
    });
    assert!(matches!(missing, AdapterError::Io { .. }), "{missing}");
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
    rewrite(&single, |n, d, s, b| {
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
            &cpu.device,
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
