//! The bad-input corpus: broken model folders, adapters, images and batch files, each generated
//! here from the fixtures. Every case must give a typed error naming the file and the problem,
//! both in-process and from `mmlora encode` (exit status 1, no panic, no output file), and the
//! engine that was handed the case must keep serving exactly as before.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{copy_dir, edit_json, family_dir, fixture_dir, keep, png_header, rewrite_safetensors};
use mmlora::engine::batch::Batch;
use mmlora::engine::{Engine, EngineError, EngineOptions, ImageSource, Request};
use mmlora::runtime::device;
use safetensors::Dtype;

/// What a case breaks, which decides how it is handed to the engine and to the CLI.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// A model folder (`Engine::open`, `--model`).
    Model,
    /// An adapter folder (`Engine::load_adapter`, `--adapter`).
    Adapter,
    /// An image file (a request of `Engine::encode`, `IMAGE`).
    Image,
    /// A batch file (`Batch::read` then the engine, `--batch`).
    Batch,
}

/// One bad input.
struct Case {
    name: &'static str,
    target: Target,
    /// Writes the broken input under the given folder and returns its path.
    make: Box<dyn Fn(&Path) -> PathBuf>,
    /// What the error must say (the file's name and the problem).
    mentions: &'static [&'static str],
}

fn case(
    name: &'static str,
    target: Target,
    mentions: &'static [&'static str],
    make: impl Fn(&Path) -> PathBuf + 'static,
) -> Case {
    Case {
        name,
        target,
        make: Box::new(make),
        mentions,
    }
}

fn fixture(path: &str) -> PathBuf {
    fixture_dir().join(path)
}

/// A copy of the fixture model folder, changed by `edit`.
fn model(dir: &Path, edit: impl FnOnce(&Path)) -> PathBuf {
    let model = dir.join("model");
    copy_dir(&fixture_dir(), &model);
    edit(&model);
    model
}

/// A copy of the fixture model folder of `family` (`assets/tiny-{family}`), changed by `edit`.
fn family_model(dir: &Path, family: &str, edit: impl FnOnce(&Path)) -> PathBuf {
    let model = dir.join("model");
    copy_dir(&family_dir(family), &model);
    edit(&model);
    model
}

/// `family`'s fixture model folder with `key` of its `vision_config` set to `value`.
fn family_config(dir: &Path, family: &str, key: &str, value: serde_json::Value) -> PathBuf {
    family_model(dir, family, |m| {
        edit_json(&m.join("config.json"), |c| c["vision_config"][key] = value)
    })
}

/// A copy of the fixture model with `preprocessor_config.json`'s `key` set to `value`.
fn processor_setting(dir: &Path, key: &str, value: serde_json::Value) -> PathBuf {
    model(dir, |m| {
        edit_json(&m.join("preprocessor_config.json"), |p| p[key] = value)
    })
}

/// A copy of adapter `name` of `family`'s fixtures.
fn family_adapter(dir: &Path, family: &str, name: &str) -> PathBuf {
    let adapter = dir.join(name);
    copy_dir(&family_dir(family).join("adapters").join(name), &adapter);
    adapter
}

/// A copy of fixture adapter `name`, changed by `edit`.
fn adapter(dir: &Path, name: &str, edit: impl FnOnce(&Path)) -> PathBuf {
    let adapter = dir.join(name);
    copy_dir(&fixture(&format!("adapters/{name}")), &adapter);
    edit(&adapter);
    adapter
}

/// A file `name` holding `bytes`.
fn file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// A batch file `batch.json` holding `json`, with `{square}` and `{adapters}` filled in.
fn batch(dir: &Path, json: &str) -> PathBuf {
    let json = json
        .replace("{square}", fixture("images/square.png").to_str().unwrap())
        .replace("{adapters}", fixture("adapters").to_str().unwrap());
    file(dir, "batch.json", json.as_bytes())
}

const BLOCKS_SHARD: &str = "model-00001-of-00002.safetensors";
const MERGER_SHARD: &str = "model-00002-of-00002.safetensors";
const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
const ADAPTER_CONFIG: &str = "adapter_config.json";
/// What a clone without `git lfs` holds in place of a large file.
const LFS_POINTER: &str = "version https://git-lfs.github.com/spec/v1\n\
    oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n\
    size 4398046511104\n";

/// Replaces the bytes of tensor `key` in the safetensors file at `path`.
fn poison(path: &Path, key: &'static str, value: f32) {
    rewrite_safetensors(path, |n, d, s, b| {
        let mut b = b.to_vec();
        if n == key {
            b[..4].copy_from_slice(&value.to_le_bytes());
        }
        keep(n, d, s, &b)
    });
}

/// The first 8 bytes of a safetensors file are the header's length.
fn set_header_len(path: &Path, len: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[..8].copy_from_slice(&len.to_le_bytes());
    std::fs::write(path, bytes).unwrap();
}

/// Rewrites the JSON header of the safetensors file at `path` (the data stays).
fn edit_header(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let bytes = std::fs::read(path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    edit(&mut header);
    let mut text = header.to_string().into_bytes();
    while text.len() < len {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(&bytes[8 + len..]);
    std::fs::write(path, out).unwrap();
}

/// A JPEG whose frame header claims `width × height`.
fn jpeg_claiming(width: u16, height: u16) -> Vec<u8> {
    let mut bytes = std::fs::read(fixture("images/wide.jpg")).unwrap();
    let sof = bytes
        .windows(2)
        .position(|w| w[0] == 0xFF && matches!(w[1], 0xC0..=0xC2))
        .expect("a frame header");
    bytes[sof + 5..sof + 7].copy_from_slice(&height.to_be_bytes());
    bytes[sof + 7..sof + 9].copy_from_slice(&width.to_be_bytes());
    bytes
}

/// An 8-bit PNG of `width × height`.
fn png(dir: &Path, name: &str, width: u32, height: u32) -> PathBuf {
    let path = dir.join(name);
    image::RgbImage::from_fn(width, height, |x, y| image::Rgb([x as u8, y as u8, 7]))
        .save(&path)
        .unwrap();
    path
}

/// Every case, by what it breaks.
fn cases() -> Vec<Case> {
    [
        model_cases(),
        adapter_cases(),
        image_cases(),
        batch_cases(),
        family_cases(),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// Model folders.
fn model_cases() -> Vec<Case> {
    use Target::*;
    vec![
        case("no config.json", Model, &["config.json"], |d| {
            model(d, |m| std::fs::remove_file(m.join("config.json")).unwrap())
        }),
        case(
            "config.json not JSON",
            Model,
            &["config.json", "key must be a string"],
            |d| {
                model(d, |m| {
                    std::fs::write(m.join("config.json"), "{ depth: 2 ").unwrap()
                })
            },
        ),
        case("wrong model_type", Model, &["config.json", "llava"], |d| {
            model(d, |m| {
                edit_json(&m.join("config.json"), |c| c["model_type"] = "llava".into())
            })
        }),
        case(
            "no vision_config",
            Model,
            &["config.json", "vision_config"],
            |d| {
                model(d, |m| {
                    edit_json(&m.join("config.json"), |c| {
                        c.as_object_mut().unwrap().remove("vision_config");
                    })
                })
            },
        ),
        case(
            "zero patch size",
            Model,
            &["config.json", "patch_size is 0"],
            |d| {
                model(d, |m| {
                    edit_json(&m.join("config.json"), |c| {
                        c["vision_config"]["patch_size"] = 0.into()
                    })
                })
            },
        ),
        case(
            "absurd depth",
            Model,
            &["config.json", "depth is 1000000000"],
            |d| {
                model(d, |m| {
                    edit_json(&m.join("config.json"), |c| {
                        c["vision_config"]["depth"] = 1_000_000_000.into()
                    })
                })
            },
        ),
        case(
            "heads do not divide",
            Model,
            &["config.json", "head width"],
            |d| {
                model(d, |m| {
                    edit_json(&m.join("config.json"), |c| {
                        c["vision_config"]["num_heads"] = 3.into()
                    })
                })
            },
        ),
        case("no weights at all", Model, &["model.safetensors"], |d| {
            model(d, |m| {
                std::fs::remove_file(m.join("model.safetensors.index.json")).unwrap()
            })
        }),
        case(
            "index not JSON",
            Model,
            &["model.safetensors.index.json"],
            |d| {
                model(d, |m| {
                    std::fs::write(m.join("model.safetensors.index.json"), "[").unwrap()
                })
            },
        ),
        case(
            "a shard never fetched from Git LFS",
            Model,
            &[BLOCKS_SHARD, "Git LFS pointer"],
            |d| {
                model(d, |m| {
                    std::fs::write(m.join(BLOCKS_SHARD), LFS_POINTER).unwrap()
                })
            },
        ),
        case(
            "shard named in the index missing",
            Model,
            &[MERGER_SHARD, "No such file"],
            |d| model(d, |m| std::fs::remove_file(m.join(MERGER_SHARD)).unwrap()),
        ),
        case(
            "shard that is a folder",
            Model,
            &[MERGER_SHARD, "it is a folder"],
            |d| {
                model(d, |m| {
                    std::fs::remove_file(m.join(MERGER_SHARD)).unwrap();
                    std::fs::create_dir(m.join(MERGER_SHARD)).unwrap();
                })
            },
        ),
        case(
            "truncated shard",
            Model,
            &[BLOCKS_SHARD, "not a valid checkpoint"],
            |d| {
                model(d, |m| {
                    let path = m.join(BLOCKS_SHARD);
                    let bytes = std::fs::read(&path).unwrap();
                    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
                })
            },
        ),
        case(
            "header length past the end",
            Model,
            &[BLOCKS_SHARD, "not a valid checkpoint"],
            |d| model(d, |m| set_header_len(&m.join(BLOCKS_SHARD), u64::MAX / 2)),
        ),
        case(
            "offsets past the end",
            Model,
            &[MERGER_SHARD, "not a valid checkpoint"],
            |d| {
                model(d, |m| {
                    edit_header(&m.join(MERGER_SHARD), |h| {
                        h["model.visual.merger.mlp.2.bias"]["data_offsets"][1] =
                            1_000_000_000.into()
                    })
                })
            },
        ),
        case(
            "overlapping offsets",
            Model,
            &[MERGER_SHARD, "not a valid checkpoint"],
            |d| {
                model(d, |m| {
                    edit_header(&m.join(MERGER_SHARD), |h| {
                        let first = h["model.visual.merger.ln_q.bias"]["data_offsets"].clone();
                        h["model.visual.merger.ln_q.weight"]["data_offsets"] = first;
                    })
                })
            },
        ),
        case(
            "integer weights",
            Model,
            &[MERGER_SHARD, "merger.mlp.2.bias", "I32"],
            |d| {
                model(d, |m| {
                    rewrite_safetensors(&m.join(MERGER_SHARD), |n, dt, s, b| {
                        let dt = if n.ends_with("merger.mlp.2.bias") {
                            Dtype::I32
                        } else {
                            dt
                        };
                        keep(n, dt, s, b)
                    })
                })
            },
        ),
        case(
            "misshapen weight",
            Model,
            &[MERGER_SHARD, "merger.mlp.2.bias", "expected"],
            |d| {
                model(d, |m| {
                    rewrite_safetensors(&m.join(MERGER_SHARD), |n, dt, s, b| {
                        if n.ends_with("merger.mlp.2.bias") {
                            vec![(n.to_owned(), dt, vec![s[0] - 1], b[..b.len() - 4].to_vec())]
                        } else {
                            keep(n, dt, s, b)
                        }
                    })
                })
            },
        ),
        case(
            "patch conv with channels and frames swapped",
            Model,
            &[MERGER_SHARD, "patch_embed.proj.weight", "expected"],
            |d| {
                model(d, |m| {
                    edit_header(&m.join(MERGER_SHARD), |h| {
                        let shape = &mut h["model.visual.patch_embed.proj.weight"]["shape"];
                        let (channels, frames) = (shape[1].clone(), shape[2].clone());
                        shape[1] = frames;
                        shape[2] = channels;
                    })
                })
            },
        ),
        case(
            "missing weight",
            Model,
            &["merger.ln_q.weight", "missing"],
            |d| {
                model(d, |m| {
                    rewrite_safetensors(&m.join(MERGER_SHARD), |n, dt, s, b| {
                        if n.ends_with("merger.ln_q.weight") {
                            vec![]
                        } else {
                            keep(n, dt, s, b)
                        }
                    });
                    edit_json(&m.join("model.safetensors.index.json"), |i| {
                        i["weight_map"]
                            .as_object_mut()
                            .unwrap()
                            .retain(|k, _| !k.ends_with("merger.ln_q.weight"));
                    })
                })
            },
        ),
        case(
            "NaN weight",
            Model,
            &[BLOCKS_SHARD, "blocks.0.attn.qkv.weight", "non-finite"],
            |d| {
                model(d, |m| {
                    poison(
                        &m.join(BLOCKS_SHARD),
                        "model.visual.blocks.0.attn.qkv.weight",
                        f32::NAN,
                    )
                })
            },
        ),
        case(
            "preprocessor not JSON",
            Model,
            &["preprocessor_config.json"],
            |d| {
                model(d, |m| {
                    std::fs::write(m.join("preprocessor_config.json"), "]").unwrap()
                })
            },
        ),
        case(
            "processor merges otherwise",
            Model,
            &["preprocessor_config.json", "merge_size"],
            |d| processor_setting(d, "merge_size", 1.into()),
        ),
        case(
            "nested processor merges otherwise",
            Model,
            &["processor_config.json", "merge_size is 1"],
            |d| {
                model(d, |m| {
                    // transformers 5 nests a saved processor's settings, read before
                    // preprocessor_config.json, whose merge_size stays right.
                    let mut settings: serde_json::Value = serde_json::from_str(
                        &std::fs::read_to_string(m.join("preprocessor_config.json")).unwrap(),
                    )
                    .unwrap();
                    settings["merge_size"] = 1.into();
                    let processor = serde_json::json!({"image_processor": settings});
                    std::fs::write(m.join("processor_config.json"), processor.to_string()).unwrap()
                })
            },
        ),
        case(
            "processor resamples with nearest",
            Model,
            &["preprocessor_config.json", "resample", "is 0"],
            |d| processor_setting(d, "resample", 0.into()),
        ),
        case(
            "processor resamples with box, which torchvision has not",
            Model,
            &["preprocessor_config.json", "resample", "torchvision"],
            |d| processor_setting(d, "resample", 4.into()),
        ),
        case(
            "processor patch 0",
            Model,
            &["preprocessor_config.json", "patch_size", "is 0"],
            |d| processor_setting(d, "patch_size", 0.into()),
        ),
    ]
}

/// Adapter folders.
fn adapter_cases() -> Vec<Case> {
    use Target::*;
    vec![
        case(
            "no adapter_config.json",
            Adapter,
            &[ADAPTER_CONFIG, "No such file"],
            |d| {
                adapter(d, "all-r4", |a| {
                    std::fs::remove_file(a.join(ADAPTER_CONFIG)).unwrap()
                })
            },
        ),
        case(
            "adapter_config.json not JSON",
            Adapter,
            &[ADAPTER_CONFIG, "malformed"],
            |d| {
                adapter(d, "all-r4", |a| {
                    std::fs::write(a.join(ADAPTER_CONFIG), "{").unwrap()
                })
            },
        ),
        case("rank 0", Adapter, &[ADAPTER_CONFIG, "r is 0"], |d| {
            adapter(d, "all-r4", |a| {
                edit_json(&a.join(ADAPTER_CONFIG), |c| c["r"] = 0.into())
            })
        }),
        case(
            "rank above max_rank",
            Adapter,
            &[ADAPTER_WEIGHTS, "rank 128", "max_rank 64"],
            |d| {
                adapter(d, "all-r4", |a| {
                    edit_json(&a.join(ADAPTER_CONFIG), |c| c["r"] = 128.into())
                })
            },
        ),
        case(
            "rank_pattern rank 0",
            Adapter,
            &[ADAPTER_CONFIG, "rank 0"],
            |d| {
                adapter(d, "patterns", |a| {
                    edit_json(&a.join(ADAPTER_CONFIG), |c| {
                        c["rank_pattern"]["fc1"] = 0.into()
                    })
                })
            },
        ),
        case(
            "rank_pattern not a regex",
            Adapter,
            &[ADAPTER_CONFIG, "not a valid regex"],
            |d| {
                adapter(d, "patterns", |a| {
                    edit_json(&a.join(ADAPTER_CONFIG), |c| {
                        c["rank_pattern"]["fc1("] = 2.into()
                    })
                })
            },
        ),
        case("zero alpha", Adapter, &[ADAPTER_CONFIG, "alpha 0"], |d| {
            adapter(d, "all-r4", |a| {
                edit_json(&a.join(ADAPTER_CONFIG), |c| c["lora_alpha"] = 0.into())
            })
        }),
        case(
            "PiSSA not converted",
            Adapter,
            &[ADAPTER_CONFIG, "init_lora_weights = pissa_niter_4"],
            |d| {
                adapter(d, "all-r4", |a| {
                    edit_json(&a.join(ADAPTER_CONFIG), |c| {
                        c["init_lora_weights"] = "pissa_niter_4".into()
                    })
                })
            },
        ),
        case("DoRA", Adapter, &[ADAPTER_CONFIG, "DoRA"], |d| {
            adapter(d, "all-r4", |a| {
                edit_json(&a.join(ADAPTER_CONFIG), |c| c["use_dora"] = true.into())
            })
        }),
        case(
            "modules_to_save in the tower",
            Adapter,
            &[ADAPTER_WEIGHTS, "merger.ln_q.weight", "modules_to_save"],
            |d| {
                adapter(d, "all-r4", |a| {
                    edit_json(&a.join(ADAPTER_CONFIG), |c| {
                        c["modules_to_save"] = serde_json::json!(["merger.ln_q"])
                    });
                    // PEFT saves the trained module whole beside the LoRA weights.
                    rewrite_safetensors(&a.join(ADAPTER_WEIGHTS), |n, d, s, b| {
                        let mut tensors = keep(n, d, s, b);
                        if n.ends_with("merger.mlp.0.lora_A.weight") {
                            let ln_q = "base_model.model.model.visual.merger.ln_q.weight";
                            tensors.push((ln_q.to_owned(), Dtype::F32, vec![32], vec![0; 128]));
                        }
                        tensors
                    })
                })
            },
        ),
        case(
            "adapter weights never fetched from Git LFS",
            Adapter,
            &[ADAPTER_WEIGHTS, "Git LFS pointer"],
            |d| {
                adapter(d, "all-r4", |a| {
                    std::fs::write(a.join(ADAPTER_WEIGHTS), LFS_POINTER).unwrap()
                })
            },
        ),
        case(
            "activated LoRA",
            Adapter,
            &[ADAPTER_CONFIG, "alora_invocation_tokens"],
            |d| {
                adapter(d, "all-r4", |a| {
                    edit_json(&a.join(ADAPTER_CONFIG), |c| {
                        c["alora_invocation_tokens"] = serde_json::json!([5, 6])
                    })
                })
            },
        ),
        case(
            "trained bias",
            Adapter,
            &[ADAPTER_CONFIG, "bias = all"],
            |d| {
                adapter(d, "all-r4", |a| {
                    edit_json(&a.join(ADAPTER_CONFIG), |c| c["bias"] = "all".into())
                })
            },
        ),
        case(
            "not LoRA",
            Adapter,
            &[ADAPTER_CONFIG, "PREFIX_TUNING"],
            |d| {
                adapter(d, "all-r4", |a| {
                    // Another method's config lacks LoRA's fields.
                    edit_json(&a.join(ADAPTER_CONFIG), |c| {
                        c["peft_type"] = "PREFIX_TUNING".into();
                        let lora = c.as_object_mut().unwrap();
                        lora.remove("r");
                        lora.remove("lora_alpha");
                    })
                })
            },
        ),
        case(
            "target regex matches nothing",
            Adapter,
            &[ADAPTER_WEIGHTS, "target_modules"],
            |d| {
                adapter(d, "tower-r2", |a| {
                    edit_json(&a.join(ADAPTER_CONFIG), |c| {
                        c["target_modules"] = r".*\.nothing_here".into()
                    })
                })
            },
        ),
        case(
            "unknown target module",
            Adapter,
            &[ADAPTER_WEIGHTS, "mlp.fc9"],
            |d| {
                adapter(d, "tower-r2", |a| {
                    rewrite_safetensors(&a.join(ADAPTER_WEIGHTS), |n, dt, s, b| {
                        keep(&n.replace("mlp.fc1", "mlp.fc9"), dt, s, b)
                    })
                })
            },
        ),
        case(
            "missing lora_B",
            Adapter,
            &[ADAPTER_WEIGHTS, "partner is missing"],
            |d| {
                adapter(d, "tower-r2", |a| {
                    rewrite_safetensors(&a.join(ADAPTER_WEIGHTS), |n, dt, s, b| {
                        if n.contains("blocks.0.mlp.fc1.lora_B") {
                            vec![]
                        } else {
                            keep(n, dt, s, b)
                        }
                    })
                })
            },
        ),
        case(
            "shapes that do not fit",
            Adapter,
            &[ADAPTER_WEIGHTS, "lora_A.weight", "shape"],
            |d| {
                adapter(d, "rslora-r8", |a| {
                    edit_json(&a.join(ADAPTER_CONFIG), |c| c["r"] = 4.into())
                })
            },
        ),
        case(
            "DoRA magnitudes in the weights",
            Adapter,
            &[ADAPTER_WEIGHTS, "lora_magnitude_vector"],
            |d| {
                adapter(d, "tower-r2", |a| {
                    rewrite_safetensors(&a.join(ADAPTER_WEIGHTS), |n, dt, s, b| {
                        let mut out = keep(n, dt, s, b);
                        if n.contains("blocks.0.mlp.fc1.lora_B") {
                            let key = n.replace("lora_B.weight", "lora_magnitude_vector");
                            out.push((key, dt, vec![s[0]], vec![0; s[0] * 4]));
                        }
                        out
                    })
                })
            },
        ),
        case(
            "NaN in lora_A",
            Adapter,
            &[ADAPTER_WEIGHTS, "lora_A", "non-finite"],
            |d| {
                adapter(d, "tower-r2", |a| {
                    rewrite_safetensors(&a.join(ADAPTER_WEIGHTS), |n, dt, s, b| {
                        let mut b = b.to_vec();
                        if n.contains("blocks.1.attn.qkv.lora_A") {
                            b[..4].copy_from_slice(&f32::INFINITY.to_le_bytes());
                        }
                        keep(n, dt, s, &b)
                    })
                })
            },
        ),
        case(
            "integer adapter weights",
            Adapter,
            &[ADAPTER_WEIGHTS, "I32"],
            |d| {
                adapter(d, "tower-r2", |a| {
                    rewrite_safetensors(&a.join(ADAPTER_WEIGHTS), |n, _, s, b| {
                        keep(n, Dtype::I32, s, b)
                    })
                })
            },
        ),
        case(
            "no vision weights",
            Adapter,
            &[ADAPTER_WEIGHTS, "no LoRA weight"],
            |d| {
                adapter(d, "tower-r2", |a| {
                    rewrite_safetensors(&a.join(ADAPTER_WEIGHTS), |n, dt, s, b| {
                        keep(
                            &n.replace("visual.blocks", "language_model.layers"),
                            dt,
                            s,
                            b,
                        )
                    })
                })
            },
        ),
        case(
            "weights not safetensors",
            Adapter,
            &[ADAPTER_WEIGHTS, "malformed"],
            |d| {
                adapter(d, "all-r4", |a| {
                    std::fs::write(a.join(ADAPTER_WEIGHTS), b"garbage").unwrap()
                })
            },
        ),
        case(
            "no weights file",
            Adapter,
            &[ADAPTER_WEIGHTS, "No such file"],
            |d| {
                adapter(d, "all-r4", |a| {
                    std::fs::remove_file(a.join(ADAPTER_WEIGHTS)).unwrap()
                })
            },
        ),
    ]
}

/// Images.
fn image_cases() -> Vec<Case> {
    use Target::*;
    vec![
        case("empty file", Image, &["empty.png"], |d| {
            file(d, "empty.png", b"")
        }),
        case("not an image", Image, &["notes.png"], |d| {
            file(d, "notes.png", b"hello, world")
        }),
        case("truncated PNG", Image, &["cut.png"], |d| {
            let bytes = std::fs::read(fixture("images/square.png")).unwrap();
            file(d, "cut.png", &bytes[..bytes.len() / 2])
        }),
        case(
            "truncated JPEG",
            Image,
            &["cut.jpg", "Premature end"],
            |d| {
                let bytes = std::fs::read(fixture("images/wide.jpg")).unwrap();
                file(d, "cut.jpg", &bytes[..bytes.len() / 2])
            },
        ),
        case(
            "PNG claiming 30000×30000",
            Image,
            &["huge.png", "above the limit"],
            |d| file(d, "huge.png", &png_header(30_000, 30_000)),
        ),
        case(
            "JPEG claiming 30000×30000",
            Image,
            &["huge.jpg", "above the limit"],
            |d| file(d, "huge.jpg", &jpeg_claiming(30_000, 30_000)),
        ),
        case("animated GIF", Image, &["anim.gif", "Gif"], |d| {
            let mut gif = b"GIF89a\x02\x00\x02\x00\x80\x00\x00\xff\xff\xff\x00\x00\x00".to_vec();
            gif.extend(b"\x21\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00;");
            file(d, "anim.gif", &gif)
        }),
        case(
            "aspect ratio above 200",
            Image,
            &["sliver.png", "aspect ratio"],
            |d| png(d, "sliver.png", 402, 2),
        ),
        case(
            "missing image",
            Image,
            &["absent.png", "No such file"],
            |d| d.join("absent.png"),
        ),
    ]
}

/// Batch files.
fn batch_cases() -> Vec<Case> {
    use Target::*;
    vec![
        case("batch not JSON", Batch, &["batch.json", "EOF"], |d| {
            batch(d, r#"{"requests": [{"id": "a""#)
        }),
        case(
            "duplicate ids",
            Batch,
            &["batch.json", "more than once"],
            |d| {
                batch(
                    d,
                    r#"{"requests": [{"id": "a", "image": "{square}"}, {"id": "a", "image": "{square}"}]}"#,
                )
            },
        ),
        case("unknown adapter", Batch, &["batch.json", "ghost"], |d| {
            batch(
                d,
                r#"{"requests": [{"id": "a", "image": "{square}", "adapter": "ghost"}]}"#,
            )
        }),
        case("no requests", Batch, &["batch.json", "no requests"], |d| {
            batch(d, r#"{"requests": []}"#)
        }),
        case("unknown field", Batch, &["batch.json", "adaptor"], |d| {
            batch(
                d,
                r#"{"requests": [{"id": "a", "image": "{square}", "adaptor": "x"}]}"#,
            )
        }),
        case(
            "image that does not exist",
            Batch,
            &["nowhere.png", "No such file"],
            |d| batch(d, r#"{"requests": [{"id": "a", "image": "nowhere.png"}]}"#),
        ),
        case(
            "adapter folder that does not exist",
            Batch,
            &["no-such-adapter", "No such file"],
            |d| {
                batch(
                    d,
                    r#"{"adapters": {"x": "no-such-adapter"}, "requests": [{"id": "a", "image": "{square}", "adapter": "x"}]}"#,
                )
            },
        ),
        case(
            "batch file that does not exist",
            Batch,
            &["absent.json", "No such file"],
            |d| d.join("absent.json"),
        ),
    ]
}

/// The other families' folders: what their configs and checkpoints must hold.
fn family_cases() -> Vec<Case> {
    use Target::*;
    vec![
        case(
            "Qwen3-VL position table not square",
            Model,
            &["config.json", "num_position_embeddings 24 is not a square"],
            |d| family_config(d, "qwen3-vl", "num_position_embeddings", 24.into()),
        ),
        case(
            "Qwen3-VL position table of another size",
            Model,
            &["pos_embed.weight"],
            |d| family_config(d, "qwen3-vl", "num_position_embeddings", 36.into()),
        ),
        case(
            "Qwen3-VL deepstack block past the tower",
            Model,
            &["config.json", "deepstack_visual_indexes names block 4"],
            |d| family_config(d, "qwen3-vl", "deepstack_visual_indexes", [1, 4].into()),
        ),
        case(
            "Qwen3-VL deepstack merger the checkpoint lacks",
            Model,
            &["deepstack_merger_list.2."],
            |d| family_config(d, "qwen3-vl", "deepstack_visual_indexes", [1, 2, 3].into()),
        ),
        case(
            "Qwen2.5-VL window not whole merge blocks",
            Model,
            &["config.json", "window_size 50 is not a whole number"],
            |d| family_config(d, "qwen2.5-vl", "window_size", 50.into()),
        ),
        case(
            "Qwen3-VL deepstack adapter on a model without deepstack",
            Adapter,
            &[
                ADAPTER_WEIGHTS,
                "deepstack_merger_list.",
                "is not a LoRA target",
            ],
            |d| family_adapter(d, "qwen3-vl", "deepstack-r4"),
        ),
        case(
            "Qwen2.5-VL gated-MLP adapter on Qwen2-VL",
            Adapter,
            // Keys are checked in name order: blocks.0's attn.proj fits, its gate_proj not.
            &[
                ADAPTER_WEIGHTS,
                "blocks.0.mlp.gate_proj.lora_A.weight",
                "is not a LoRA target",
            ],
            |d| family_adapter(d, "qwen2.5-vl", "patterns"),
        ),
    ]
}

/// The engine every in-process case is handed, and what it answers before any case.
struct Serving {
    engine: Engine,
    probe: Vec<Request>,
    answer: Vec<Vec<f32>>,
    adapters: Vec<String>,
}

impl Serving {
    fn new() -> Self {
        let mut engine =
            Engine::open(&fixture_dir(), device::cpu(), EngineOptions::default()).unwrap();
        for name in ["all-r4", "tower-r2"] {
            engine
                .load_adapter(name, &fixture(&format!("adapters/{name}")))
                .unwrap();
        }
        let probe: Vec<Request> = [Some("all-r4"), None, Some("tower-r2")]
            .into_iter()
            .enumerate()
            .map(|(i, adapter)| Request {
                id: format!("probe{i}"),
                image: ImageSource::File(fixture("images/wide.jpg")),
                adapter: adapter.map(str::to_owned),
            })
            .collect();
        let answer = Self::answer(&mut engine, &probe);
        let adapters = engine.adapter_names();
        Self {
            engine,
            probe,
            answer,
            adapters,
        }
    }

    fn answer(engine: &mut Engine, probe: &[Request]) -> Vec<Vec<f32>> {
        engine
            .encode(probe, false)
            .unwrap()
            .into_iter()
            .map(|r| r.embeds.values)
            .collect()
    }

    /// Hands the engine `path` as a case of `target`; returns the error's text.
    fn refuse(&mut self, target: Target, path: &Path) -> String {
        let cpu = || device::cpu();
        let error: Option<String> = match target {
            Target::Model => Engine::open(path, cpu(), EngineOptions::default())
                .err()
                .map(|e| e.to_string()),
            Target::Adapter => self
                .engine
                .load_adapter("broken", path)
                .err()
                .map(|e| e.to_string()),
            Target::Image => {
                let mut requests = self.probe.clone();
                requests.insert(
                    1,
                    Request {
                        // Not the file's name: the error itself must name the file.
                        id: "broken".to_owned(),
                        image: ImageSource::File(path.to_owned()),
                        adapter: Some("all-r4".to_owned()),
                    },
                );
                self.engine
                    .encode(&requests, false)
                    .err()
                    .map(|e| e.to_string())
            }
            Target::Batch => match Batch::read(path) {
                Err(e) => Some(e.to_string()),
                Ok(batch) => self.run_batch(&batch).err().map(|e| e.to_string()),
            },
        };
        error.unwrap_or_else(|| panic!("{} was accepted", path.display()))
    }

    /// Loads a batch's adapters under names of their own, then encodes it.
    fn run_batch(&mut self, batch: &Batch) -> Result<(), EngineError> {
        for (name, dir) in &batch.adapters {
            self.engine.load_adapter(name, dir)?;
        }
        self.engine.encode(&batch.requests, false).map(|_| ())
    }

    /// The engine answers the probe as before any case, with the same adapters.
    fn assert_unchanged(&mut self, case: &str) {
        assert_eq!(self.engine.adapter_names(), self.adapters, "after {case}");
        assert_eq!(
            Self::answer(&mut self.engine, &self.probe),
            self.answer,
            "after {case}"
        );
    }
}

/// `mmlora encode` handed `path` as a case of `target`, writing to `out`.
fn cli(target: Target, path: &Path, out: &Path) -> std::process::Output {
    let square = fixture("images/square.png");
    let all_r4 = fixture("adapters/all-r4");
    let path = path.as_os_str();
    let args: Vec<&std::ffi::OsStr> = match target {
        Target::Model => vec![square.as_os_str(), "--model".as_ref(), path],
        Target::Adapter => vec![square.as_os_str(), "--adapter".as_ref(), path],
        Target::Image => vec![path, "--adapter".as_ref(), all_r4.as_os_str()],
        Target::Batch => vec!["--batch".as_ref(), path],
    };
    Command::new(env!("CARGO_BIN_EXE_mmlora"))
        .args(["encode", "--device", "cpu"])
        .args(args)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

#[test]
fn every_bad_input_is_a_typed_error_and_the_engine_keeps_serving() {
    let cases = cases();
    // As many as README.md counts, so that no case goes missing unnoticed.
    assert_eq!(cases.len(), 75, "the corpus has {} cases", cases.len());
    let mut serving = Serving::new();
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let dir = tempfile::TempDir::new().unwrap();
        let path = (case.make)(dir.path());
        let in_process = serving.refuse(case.target, &path);
        let out = dir.path().join("out.safetensors");
        let run = cli(case.target, &path, &out);
        let stderr = String::from_utf8_lossy(&run.stderr);
        println!("{i:2} {:?} {}: {in_process}", case.target, case.name);
        let mut fail = |what: String| failures.push(format!("{}: {what}", case.name));
        for mention in case.mentions {
            if !in_process.contains(mention) {
                fail(format!("{mention:?} not in {in_process}"));
            }
            if !stderr.contains(mention) {
                fail(format!("{mention:?} not in the CLI's {stderr}"));
            }
        }
        if run.status.code() != Some(1) || stderr.contains("panicked") {
            fail(format!("exit {:?}: {stderr}", run.status.code()));
        }
        if out.exists() {
            fail(format!("the CLI left {}", out.display()));
        }
        serving.assert_unchanged(case.name);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
