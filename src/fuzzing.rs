//! The checks behind the `cargo fuzz` targets in `fuzz/`: each takes arbitrary bytes and panics
//! only when mmlora breaks a promise (a panic of its own, or an invariant violated). They live
//! here so that `tests/fuzz_corpus.rs` replays the committed corpora on stable Rust in CI.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroUsize;
use std::path::Path;
use std::sync::LazyLock;

use arbitrary::{Result, Unstructured};

use crate::adapters::{AdapterConfig, PeftAdapter};
use crate::engine::batch::{Batch, BatchError};
use crate::models::{self, LoraTarget};
use crate::routing::mapping::{
    AdapterId, AdapterRequest, EncoderCache, LoraState, MmFeature, Modality, NO_ADAPTER,
    PlaceholderRange, SpatialMergeCounts, set_active_mm_loras,
};
use crate::routing::meta::{KernelMeta, NO_SLOT, SlotTable};

/// The highest rank the adapter checks accept.
const MAX_RANK: usize = 16;

/// A fixture model of each family (`assets/tiny-{family}`): the adapter checks run against
/// each one's targets, with each one's adapters.
const FAMILIES: [&str; 3] = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"];

/// A family's fixture folder, its LoRA targets, its `patterns` adapter's weights and its
/// `all-r4` adapter's configuration.
struct Family {
    targets: Vec<LoraTarget>,
    patterns_weights: Vec<u8>,
    all_r4: AdapterConfig,
}

static FAMILY_FIXTURES: LazyLock<Vec<Family>> = LazyLock::new(|| {
    FAMILIES
        .iter()
        .map(|family| {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("assets/tiny-{family}"));
            let adapters = dir.join("adapters");
            Family {
                targets: models::lora_targets(&dir).expect("the fixture model's config"),
                patterns_weights: std::fs::read(
                    adapters.join("patterns/adapter_model.safetensors"),
                )
                .expect("the fixture adapter"),
                all_r4: AdapterConfig::read("all-r4", &adapters.join("all-r4"))
                    .expect("the fixture adapter"),
            }
        })
        .collect()
});

/// `adapter_config.json` text `data`, then each family's `patterns` adapter's weights under
/// that configuration: a typed error, or an adapter with ranks in range and finite values that
/// passes its own check.
pub fn adapter_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let dir = Path::new("/fuzz/adapter");
    let Ok(config) = AdapterConfig::parse("fuzz", &dir.join("adapter_config.json"), text) else {
        return;
    };
    assert!(config.r > 0 && config.lora_alpha.is_finite() && config.lora_alpha != 0.0);
    for family in FAMILY_FIXTURES.iter() {
        let (weights, targets) = (&family.patterns_weights, &family.targets);
        let Ok(adapter) =
            PeftAdapter::from_safetensors("fuzz", dir, config.clone(), weights, targets, MAX_RANK)
        else {
            continue;
        };
        adapter
            .check(targets, MAX_RANK)
            .expect("a loaded adapter passes its own check");
        for module in adapter.modules.values() {
            assert!(module.scale.is_finite());
            assert!(module.a.iter().chain(&module.b).all(|v| v.is_finite()));
        }
    }
}

/// `adapter_model.safetensors` bytes `data` under each family's `all-r4` configuration, on its
/// model: a typed error, or an adapter that fits the model and holds no more values than the
/// bytes could carry.
pub fn adapter_safetensors(data: &[u8]) {
    let dir = Path::new("/fuzz/adapter");
    for family in FAMILY_FIXTURES.iter() {
        let (config, targets) = (family.all_r4.clone(), &family.targets);
        let Ok(adapter) =
            PeftAdapter::from_safetensors("fuzz", dir, config, data, targets, MAX_RANK)
        else {
            continue;
        };
        adapter
            .check(targets, MAX_RANK)
            .expect("a loaded adapter passes its own check");
        let values: usize = adapter
            .modules
            .values()
            .map(|m| m.a.len() + m.b.len())
            .sum();
        // Every value came from the bytes: at least two each (f16/bf16).
        assert!(values * 2 <= data.len());
    }
}

/// Batch-file text `data`: a typed error naming the file, or a batch with requests, unique ids
/// and every adapter it names listed.
pub fn batch_json(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("/jobs/batch.json");
    match Batch::parse(text, path) {
        Err(BatchError::Invalid { path: named, .. }) => assert_eq!(named, path),
        Err(other) => panic!("parsing text cannot fail to read: {other}"),
        Ok(batch) => {
            assert!(!batch.requests.is_empty());
            let mut ids = HashSet::new();
            for request in &batch.requests {
                assert!(ids.insert(&request.id), "duplicate id {}", request.id);
                if let Some(adapter) = &request.adapter {
                    assert!(batch.adapters.iter().any(|(name, _)| name == adapter));
                }
            }
        }
    }
}

/// One scheduler state, decoded from the fuzzer's bytes.
struct Case {
    merge: usize,
    cache: EncoderCache,
    batch_index: HashMap<String, usize>,
    state: LoraState,
    scheduled: Vec<(String, Vec<usize>)>,
}

fn case(u: &mut Unstructured<'_>) -> Result<Case> {
    let merge = u.int_in_range(1..=4)?;
    let requests = u.int_in_range(0..=8usize)?;
    let state_size = u.int_in_range(0..=8usize)?;
    let mut cache = EncoderCache::default();
    let mut batch_index = HashMap::new();
    let mut state = LoraState::new(state_size);
    for r in 0..requests {
        let id = format!("r{r}");
        let mut features = Vec::new();
        for _ in 0..u.int_in_range(0..=3)? {
            let length = u.int_in_range(0..=64usize)?;
            let is_embed = if u.arbitrary()? {
                Some((0..length).map(|_| u.arbitrary()).collect::<Result<_>>()?)
            } else {
                None
            };
            features.push(MmFeature {
                identifier: format!("item{}", u.int_in_range(0..=5u8)?),
                modality: u
                    .choose(&[
                        Modality::Image,
                        Modality::Video,
                        Modality::Audio,
                        Modality::PromptEmbeds,
                    ])?
                    .clone(),
                position: PlaceholderRange {
                    offset: u.int_in_range(0..=1000)?,
                    length,
                    is_embed,
                },
                has_data: u.arbitrary()?,
            });
        }
        if u.arbitrary()? {
            cache.mm_features.insert(id.clone(), features);
        }
        let index = u.int_in_range(0..=9usize)?;
        batch_index.insert(id.clone(), index);
        let adapter = match u.int_in_range(0..=4u32)? {
            0 => None,
            n => Some(AdapterRequest {
                name: format!("adapter{n}"),
                id: AdapterId::from(n - 1), // 0 is refused: "no adapter"
                path: format!("/adapters/{n}").into(),
            }),
        };
        let _ = state.add_request(&id, index, adapter);
    }
    for item in 0..=5u8 {
        if u.arbitrary()? {
            cache.encoder_outputs.insert(format!("item{item}"));
        }
    }
    let mut scheduled = Vec::new();
    for _ in 0..u.int_in_range(0..=10)? {
        let r = u.int_in_range(0..=9usize)?;
        let items = (0..u.int_in_range(0..=3)?)
            .map(|_| u.int_in_range(0..=4usize))
            .collect::<Result<_>>()?;
        scheduled.push((format!("r{r}"), items));
    }
    Ok(Case {
        merge,
        cache,
        batch_index,
        state,
        scheduled,
    })
}

/// The mapping builder and the kernel metadata on the scheduler state `data` decodes to: a
/// typed error, or mappings whose rows use only activated adapters, a connector mapping that is
/// the tower's merged, and kernel metadata that puts every row in exactly one segment of its
/// own slot.
pub fn mapping(data: &[u8]) {
    let Ok(case) = case(&mut Unstructured::new(data)) else {
        return;
    };
    let counts = SpatialMergeCounts {
        merge: NonZeroUsize::new(case.merge).expect("decoded in 1..=4"),
    };
    let Ok(Some(activation)) = set_active_mm_loras(
        &counts,
        &case.cache,
        &case.batch_index,
        &case.state,
        &case.scheduled,
    ) else {
        return;
    };
    let tower = &activation.tower;
    let connector = activation
        .connector
        .as_ref()
        .expect("Qwen2-VL has a connector");
    let ids: Vec<AdapterId> = activation.adapters.iter().map(|a| a.id).collect();
    // Adapters: each once, ascending, never the "no adapter" id, and exactly those the rows use.
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    assert!(!ids.contains(&NO_ADAPTER));
    for &id in &tower.index_mapping {
        assert!(
            id == NO_ADAPTER || ids.contains(&id),
            "row id {id} not activated"
        );
    }
    for id in &ids {
        assert!(tower.prompt_mapping.contains(id));
    }
    // The connector sees each item's tower rows merged merge² to one, with the item's adapter.
    let m2 = case.merge * case.merge;
    assert_eq!(
        tower.index_mapping.len(),
        connector.index_mapping.len() * m2
    );
    assert_eq!(tower.prompt_mapping, connector.prompt_mapping);
    for (row, &id) in connector.index_mapping.iter().enumerate() {
        assert_eq!(tower.index_mapping[row * m2], id);
    }

    // Kernel metadata: every row lands in exactly one segment of its own slot.
    let table = SlotTable::for_adapters(ids.iter().copied(), ids.len().max(1))
        .expect("the activation's adapters fit as many slots");
    for mapping in [tower, connector] {
        let meta = KernelMeta::from_mapping(mapping, &table).expect("every row id is activated");
        let mut seen = vec![false; meta.num_tokens()];
        let mut covered = 0;
        for segment in meta.lora_segments() {
            let id = table
                .adapter_in(segment.slot as usize)
                .expect("an active slot");
            for &row in &meta.sorted_tokens()[segment.start..segment.start + segment.len] {
                let row = row as usize;
                assert!(!seen[row], "row {row} in two segments");
                seen[row] = true;
                assert_eq!(mapping.index_mapping[row], id);
                covered += 1;
            }
        }
        let without = mapping
            .index_mapping
            .iter()
            .filter(|&&id| id == NO_ADAPTER)
            .count();
        assert_eq!(covered + without, meta.num_tokens());
        assert_eq!(
            meta.token_slots().iter().filter(|&&s| s == NO_SLOT).count(),
            without
        );
        assert_eq!(
            *meta.segment_starts().last().unwrap() as usize,
            meta.num_tokens()
        );
    }
}
