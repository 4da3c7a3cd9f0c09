//! The mapping builder and the kernel metadata on arbitrary scheduler states: they either refuse
//! with a `MappingError` or return mappings that satisfy the invariants every kernel relies on.

#![no_main]

use std::collections::HashMap;

use arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use mmlora::lora::meta::{KernelMeta, NO_SLOT, SlotTable};
use mmlora::mapping::{
    AdapterRequest, EncoderCache, LoraState, MmFeature, Modality, NO_ADAPTER, PlaceholderRange,
    SpatialMergeCounts, set_active_mm_loras,
};

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
                id: n - 1, // 0 is refused: "no adapter"
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

fuzz_target!(|data: &[u8]| {
    let Ok(case) = case(&mut Unstructured::new(data)) else {
        return;
    };
    let counts = SpatialMergeCounts { merge: case.merge };
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
    let connector = activation.connector.as_ref().expect("Qwen2-VL has a connector");
    let ids: Vec<u32> = activation.adapters.iter().map(|a| a.id).collect();
    // Adapters: each once, ascending, never the "no adapter" id, and exactly those the rows use.
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    assert!(!ids.contains(&NO_ADAPTER));
    for &id in &tower.index_mapping {
        assert!(id == NO_ADAPTER || ids.contains(&id), "row id {id} not activated");
    }
    for id in &ids {
        assert!(tower.prompt_mapping.contains(id));
    }
    // The connector sees each item's tower rows merged merge² to one, with the item's adapter.
    let m2 = case.merge * case.merge;
    assert_eq!(tower.index_mapping.len(), connector.index_mapping.len() * m2);
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
            let id = table.adapter_in(segment.slot as usize).expect("an active slot");
            for &row in &meta.sorted_tokens()[segment.start..segment.start + segment.len] {
                let row = row as usize;
                assert!(!seen[row], "row {row} in two segments");
                seen[row] = true;
                assert_eq!(mapping.index_mapping[row], id);
                covered += 1;
            }
        }
        let without = mapping.index_mapping.iter().filter(|&&id| id == NO_ADAPTER).count();
        assert_eq!(covered + without, meta.num_tokens());
        assert_eq!(
            meta.token_slots().iter().filter(|&&s| s == NO_SLOT).count(),
            without
        );
        assert_eq!(*meta.segment_starts().last().unwrap() as usize, meta.num_tokens());
    }
});
