//! The multimodal LoRA mapping builder: which adapter each tower and connector row belongs to.
//!
//! A port of vLLM's model-runner-V2 `set_active_mm_loras` (ARCHITECTURE.md, "The rules
//! the routing keeps").
//! For every scheduled encoder input, in scheduling order, it appends the request's adapter id
//! once to the prompt mapping and once per tower row to the TOWER index mapping; the CONNECTOR
//! mapping repeats each item's id by its connector row count. Items the encoder does not run
//! (cache hits, items without data, `prompt_embeds`) and requests outside the batch are skipped,
//! so the rows of a mapping are exactly the rows of the forward call that consumes it.
//!
//! This module only does bookkeeping: no tensors, no devices.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::num::NonZeroUsize;
use std::path::PathBuf;

/// An adapter's integer id, as vLLM's `lora_int_id` (a Python int: 64 bits, so an engine that
/// gives every load a fresh id never runs out). [`NO_ADAPTER`] (0) means "no adapter".
pub type AdapterId = u64;

/// The id carried by rows that use no adapter.
pub const NO_ADAPTER: AdapterId = 0;

/// The most rows one mapping (and so one batch's kernel metadata) holds: the LoRA kernels index
/// rows with `i32`.
pub const MAX_ROWS: usize = i32::MAX as usize;

/// Which part of the model a mapping feeds (vLLM's `LoRAMappingType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LoraMappingKind {
    /// The language model's tokens.
    Language,
    /// The vision tower's patch rows.
    Tower,
    /// The connector's (merger's) rows.
    Connector,
}

/// Per-row adapter ids for one forward call (vLLM's `LoRAMapping`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraMapping {
    /// What the mapping feeds.
    pub kind: LoraMappingKind,
    /// One adapter id per row of the forward call, in row order.
    pub index_mapping: Vec<AdapterId>,
    /// One adapter id per encoder item (or per request on the language path).
    pub prompt_mapping: Vec<AdapterId>,
    /// Whether the rows are a prefill; always true for encoder mappings.
    pub is_prefill: bool,
}

/// Where an item's embeddings land in the language model's prompt (vLLM's `PlaceholderRange`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlaceholderRange {
    /// First placeholder position in the prompt.
    pub offset: usize,
    /// Number of placeholder positions.
    pub length: usize,
    /// Which of the `length` positions receive an encoder embedding; `None` means all of them.
    pub is_embed: Option<Vec<bool>>,
}

impl PlaceholderRange {
    /// A range whose every position receives an embedding.
    pub fn new(offset: usize, length: usize) -> Self {
        Self {
            offset,
            length,
            is_embed: None,
        }
    }

    /// The number of positions that receive an encoder embedding.
    pub fn num_embeds(&self) -> usize {
        match &self.is_embed {
            None => self.length,
            Some(mask) => mask.iter().filter(|&&embed| embed).count(),
        }
    }
}

/// The kind of data behind a multimodal item.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Modality {
    /// A still image.
    Image,
    /// A video.
    Video,
    /// An audio clip.
    Audio,
    /// Precomputed prompt embeddings: never run through the encoder.
    PromptEmbeds,
}

/// One multimodal item of a request (vLLM's `MultiModalFeatureSpec`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmFeature {
    /// Content identifier; the encoder cache is keyed on it.
    pub identifier: String,
    /// What kind of data the item holds.
    pub modality: Modality,
    /// Where its embeddings go in the prompt.
    pub position: PlaceholderRange,
    /// Whether the item's data is present this step (`false`: served from elsewhere).
    pub has_data: bool,
}

/// A request's adapter (vLLM's `LoRARequest`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AdapterRequest {
    /// The adapter's name.
    pub name: String,
    /// Its integer id, greater than [`NO_ADAPTER`].
    pub id: AdapterId,
    /// Where it was loaded from.
    pub path: PathBuf,
}

/// Per-batch-slot adapter ids plus each request's adapter (vLLM's `LoraState`).
#[derive(Debug, Clone, Default)]
pub struct LoraState {
    ids: Vec<AdapterId>,
    requests: HashMap<String, AdapterRequest>,
}

impl LoraState {
    /// State for a batch of at most `max_num_reqs` requests, all without adapter.
    pub fn new(max_num_reqs: usize) -> Self {
        Self {
            ids: vec![NO_ADAPTER; max_num_reqs],
            requests: HashMap::new(),
        }
    }

    /// Puts request `req_id` at batch index `index`, with `adapter` or none.
    pub fn add_request(
        &mut self,
        req_id: &str,
        index: usize,
        adapter: Option<AdapterRequest>,
    ) -> Result<(), MappingError> {
        let slot = self
            .ids
            .get_mut(index)
            .ok_or_else(|| MappingError::BatchIndexOutOfRange {
                request: req_id.to_owned(),
                index,
            })?;
        match adapter {
            Some(adapter) if adapter.id != NO_ADAPTER => {
                *slot = adapter.id;
                self.requests.insert(req_id.to_owned(), adapter);
            }
            Some(_) => {
                return Err(MappingError::ZeroAdapterId {
                    request: req_id.to_owned(),
                });
            }
            None => {
                *slot = NO_ADAPTER;
                self.requests.remove(req_id);
            }
        }
        Ok(())
    }

    /// The adapter id at batch index `index`.
    pub fn adapter_id(&self, index: usize) -> Option<AdapterId> {
        self.ids.get(index).copied()
    }

    /// The adapter of request `req_id`, if it has one.
    pub fn adapter_request(&self, req_id: &str) -> Option<&AdapterRequest> {
        self.requests.get(req_id)
    }
}

/// The encoder cache as the mapping builder sees it: each request's items, and the identifiers
/// whose encoder outputs are already cached.
#[derive(Debug, Clone, Default)]
pub struct EncoderCache {
    /// Each request's multimodal items, indexed as the scheduler indexes them.
    pub mm_features: HashMap<String, Vec<MmFeature>>,
    /// Identifiers of items whose encoder output is cached (those items are not re-encoded).
    pub encoder_outputs: HashSet<String>,
}

/// Each request's scheduled item indices, in scheduling order (vLLM's
/// `scheduled_encoder_inputs`).
pub type ScheduledEncoderInputs = Vec<(String, Vec<usize>)>;

/// The model's token-count hooks (vLLM's `get_num_mm_encoder_tokens` and
/// `get_num_mm_connector_tokens`).
pub trait MmTokenCounts {
    /// Tower rows for an item with `num_embeds` language-model embeddings.
    fn encoder_tokens(&self, num_embeds: usize) -> usize;

    /// Connector rows for an item with `tower_tokens` tower rows; `None` when the model has no
    /// connector that takes LoRA.
    fn connector_tokens(&self, tower_tokens: usize) -> Option<usize>;
}

/// The Qwen-VL family's counts: `num_embeds · merge²` tower rows per item (the patches before the
/// spatial merge) and `tower / merge²` connector rows (the merger's linears see merged rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpatialMergeCounts {
    /// The spatial merge size (2 for Qwen2-VL).
    pub merge: NonZeroUsize,
}

impl SpatialMergeCounts {
    /// Rows merged into one: `merge²` (saturating).
    fn block(&self) -> usize {
        self.merge.get().saturating_mul(self.merge.get())
    }
}

impl MmTokenCounts for SpatialMergeCounts {
    /// `num_embeds · merge²`, saturating (the builder refuses a count that large).
    fn encoder_tokens(&self, num_embeds: usize) -> usize {
        num_embeds.saturating_mul(self.block())
    }

    fn connector_tokens(&self, tower_tokens: usize) -> Option<usize> {
        Some(tower_tokens / self.block())
    }
}

/// What the builder asks to activate for one encoder step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmLoraActivation {
    /// The adapters the step needs, each once, ordered by id; requests without adapter add none.
    pub adapters: Vec<AdapterRequest>,
    /// The TOWER mapping: one id per tower row.
    pub tower: LoraMapping,
    /// The CONNECTOR mapping, when the model has a connector.
    pub connector: Option<LoraMapping>,
}

/// Inconsistent inputs to the mapping builder.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MappingError {
    /// A scheduled request has no entry in the encoder cache.
    #[error("request `{request}` is scheduled but has no multimodal items")]
    MissingFeatures {
        /// The request id.
        request: String,
    },
    /// A scheduled item index is past the request's items.
    #[error("request `{request}` schedules item {item} but has only {available} items")]
    ItemOutOfRange {
        /// The request id.
        request: String,
        /// The scheduled item index.
        item: usize,
        /// How many items the request has.
        available: usize,
    },
    /// A step maps more rows than the LoRA kernels index.
    #[error(
        "the step maps {rows} {kind:?} rows, more than the LoRA kernels index ({})",
        MAX_ROWS
    )]
    TooManyRows {
        /// Which mapping.
        kind: LoraMappingKind,
        /// Its rows, counting up to the first that overflowed (saturated at `usize::MAX`).
        rows: usize,
    },
    /// A request's batch index is past the adapter state.
    #[error("request `{request}` has batch index {index}, past the LoRA state")]
    BatchIndexOutOfRange {
        /// The request id.
        request: String,
        /// Its batch index.
        index: usize,
    },
    /// An adapter request carries id 0, which means "no adapter".
    #[error("request `{request}` names an adapter with id 0, which is reserved for none")]
    ZeroAdapterId {
        /// The request id.
        request: String,
    },
    /// The adapter id at a request's batch index is not the request's own adapter (two requests
    /// share a batch index).
    #[error(
        "request `{request}`: batch index {index} holds adapter id {id}, not the request's adapter"
    )]
    StateMismatch {
        /// The request id.
        request: String,
        /// Its batch index.
        index: usize,
        /// The id found at that index.
        id: AdapterId,
    },
}

/// Builds the TOWER and CONNECTOR mappings for one encoder step.
///
/// `scheduled` lists, in scheduling order, each request's scheduled item indices. Returns
/// `Ok(None)` when nothing is encoded this step (no activation).
pub fn set_active_mm_loras(
    model: &impl MmTokenCounts,
    encoder_cache: &EncoderCache,
    req_id_to_index: &HashMap<String, usize>,
    lora_state: &LoraState,
    scheduled: &[(String, Vec<usize>)],
) -> Result<Option<MmLoraActivation>, MappingError> {
    let mut prompt_mapping = Vec::new();
    let mut tower_mapping = Vec::new();
    let mut tower_counts = Vec::new();
    let mut adapters = BTreeMap::new();

    for (req_id, items) in scheduled {
        let Some(&index) = req_id_to_index.get(req_id) else {
            continue; // not in the persistent batch
        };
        let adapter_id =
            lora_state
                .adapter_id(index)
                .ok_or_else(|| MappingError::BatchIndexOutOfRange {
                    request: req_id.clone(),
                    index,
                })?;
        let features =
            encoder_cache
                .mm_features
                .get(req_id)
                .ok_or_else(|| MappingError::MissingFeatures {
                    request: req_id.clone(),
                })?;
        for &item in items {
            let feature = features
                .get(item)
                .ok_or_else(|| MappingError::ItemOutOfRange {
                    request: req_id.clone(),
                    item,
                    available: features.len(),
                })?;
            if !is_encoded(feature, encoder_cache) {
                continue;
            }
            let tower_tokens = model.encoder_tokens(feature.position.num_embeds());
            check_rows(LoraMappingKind::Tower, tower_mapping.len(), tower_tokens)?;
            prompt_mapping.push(adapter_id);
            tower_mapping.extend(std::iter::repeat_n(adapter_id, tower_tokens));
            tower_counts.push(tower_tokens);
            if adapter_id != NO_ADAPTER {
                match lora_state.adapter_request(req_id) {
                    Some(request) if request.id == adapter_id => {
                        adapters.insert(request.id, request.clone());
                    }
                    _ => {
                        return Err(MappingError::StateMismatch {
                            request: req_id.clone(),
                            index,
                            id: adapter_id,
                        });
                    }
                }
            }
        }
    }

    if prompt_mapping.is_empty() {
        return Ok(None);
    }

    let connector = connector_mapping(model, &prompt_mapping, &tower_counts)?;
    Ok(Some(MmLoraActivation {
        adapters: adapters.into_values().collect(),
        tower: LoraMapping {
            kind: LoraMappingKind::Tower,
            index_mapping: tower_mapping,
            prompt_mapping,
            is_prefill: true,
        },
        connector,
    }))
}

/// Whether the encoder runs `feature` this step: it has data, is not precomputed prompt
/// embeddings, and is not already in the encoder cache.
fn is_encoded(feature: &MmFeature, encoder_cache: &EncoderCache) -> bool {
    feature.has_data
        && feature.modality != Modality::PromptEmbeds
        && !encoder_cache.encoder_outputs.contains(&feature.identifier)
}

/// Refuses adding `more` rows to a `kind` mapping of `rows` rows past [`MAX_ROWS`], before
/// anything is allocated for them.
fn check_rows(kind: LoraMappingKind, rows: usize, more: usize) -> Result<(), MappingError> {
    let rows = rows.saturating_add(more);
    if rows > MAX_ROWS {
        return Err(MappingError::TooManyRows { kind, rows });
    }
    Ok(())
}

/// Repeats each item's id by its connector row count; `None` when the model has no connector.
fn connector_mapping(
    model: &impl MmTokenCounts,
    prompt_mapping: &[AdapterId],
    tower_counts: &[usize],
) -> Result<Option<LoraMapping>, MappingError> {
    let mut index_mapping = Vec::new();
    for (&adapter_id, &tower_tokens) in prompt_mapping.iter().zip(tower_counts) {
        let Some(rows) = model.connector_tokens(tower_tokens) else {
            return Ok(None);
        };
        check_rows(LoraMappingKind::Connector, index_mapping.len(), rows)?;
        index_mapping.extend(std::iter::repeat_n(adapter_id, rows));
    }
    Ok(Some(LoraMapping {
        kind: LoraMappingKind::Connector,
        index_mapping,
        prompt_mapping: prompt_mapping.to_vec(),
        is_prefill: true,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The upstream test's mock model: `n + 1` tower rows, `n + 10` connector rows.
    struct MockModel {
        connector: bool,
    }

    impl MmTokenCounts for MockModel {
        fn encoder_tokens(&self, num_embeds: usize) -> usize {
            num_embeds + 1
        }
        fn connector_tokens(&self, tower_tokens: usize) -> Option<usize> {
            self.connector.then_some(tower_tokens + 10)
        }
    }

    /// Qwen2-VL's counts.
    const QWEN2_VL: SpatialMergeCounts = SpatialMergeCounts {
        merge: NonZeroUsize::new(2).unwrap(),
    };

    fn image(identifier: &str, offset: usize, length: usize) -> MmFeature {
        MmFeature {
            identifier: identifier.to_owned(),
            modality: Modality::Image,
            position: PlaceholderRange::new(offset, length),
            has_data: true,
        }
    }

    fn vision_lora() -> AdapterRequest {
        AdapterRequest {
            name: "vision-lora".to_owned(),
            id: 7,
            path: PathBuf::from("/tmp/vision-lora"),
        }
    }

    /// The upstream fixture: `req-with-lora` (adapter 7, items of length 2 and 3),
    /// `req-no-lora` (one item of length 1), both in the batch.
    fn upstream_fixture() -> (EncoderCache, HashMap<String, usize>, LoraState) {
        let mut cache = EncoderCache::default();
        cache.mm_features.insert(
            "req-with-lora".to_owned(),
            vec![image("img-0", 0, 2), image("img-1", 2, 3)],
        );
        cache
            .mm_features
            .insert("req-no-lora".to_owned(), vec![image("img-2", 0, 1)]);
        let mut state = LoraState::new(4);
        state
            .add_request("req-with-lora", 0, Some(vision_lora()))
            .unwrap();
        state.add_request("req-no-lora", 1, None).unwrap();
        let index = HashMap::from([
            ("req-with-lora".to_owned(), 0),
            ("req-no-lora".to_owned(), 1),
        ]);
        (cache, index, state)
    }

    fn scheduled(items: &[(&str, &[usize])]) -> ScheduledEncoderInputs {
        items
            .iter()
            .map(|(req, idx)| (req.to_string(), idx.to_vec()))
            .collect()
    }

    #[test]
    fn rows_past_the_kernels_are_refused_before_they_are_allocated() {
        let (mut cache, index, state) = upstream_fixture();
        let schedule = scheduled(&[("req-with-lora", &[0, 1])]);
        // 2^30 embeds are 2^32 tower rows at merge 2; the second item's count overflows usize.
        let huge = [1 << 30, usize::MAX];
        for length in huge {
            cache.mm_features.insert(
                "req-with-lora".to_owned(),
                vec![image("img-0", 0, 2), image("img-1", 2, length)],
            );
            let refused = set_active_mm_loras(&QWEN2_VL, &cache, &index, &state, &schedule);
            let Err(MappingError::TooManyRows { kind, rows }) = refused else {
                panic!("{length} embeds: {refused:?}");
            };
            assert_eq!(kind, LoraMappingKind::Tower);
            assert_eq!(rows, 8usize.saturating_add(length.saturating_mul(4)));
        }
        // A connector with more rows than the kernels index, behind a tower within them.
        struct Wide;
        impl MmTokenCounts for Wide {
            fn encoder_tokens(&self, num_embeds: usize) -> usize {
                num_embeds
            }
            fn connector_tokens(&self, _: usize) -> Option<usize> {
                Some(MAX_ROWS + 1)
            }
        }
        cache.mm_features.insert(
            "req-with-lora".to_owned(),
            vec![image("img-0", 0, 2), image("img-1", 2, 3)],
        );
        let refused = set_active_mm_loras(&Wide, &cache, &index, &state, &schedule);
        assert!(
            matches!(
                refused,
                Err(MappingError::TooManyRows {
                    kind: LoraMappingKind::Connector,
                    ..
                })
            ),
            "{refused:?}"
        );
    }

    #[test]
    fn set_active_mm_loras_builds_tower_and_connector_mappings() {
        let (cache, index, state) = upstream_fixture();
        let model = MockModel { connector: true };
        let schedule = scheduled(&[
            ("req-with-lora", &[1, 0]),
            ("req-no-lora", &[0]),
            ("missing-req", &[0]),
        ]);

        let activation = set_active_mm_loras(&model, &cache, &index, &state, &schedule)
            .unwrap()
            .expect("items were scheduled");

        // One tower and one connector mapping, both for adapter 7 only.
        assert_eq!(activation.adapters, vec![vision_lora()]);
        let tower = &activation.tower;
        assert_eq!(tower.kind, LoraMappingKind::Tower);
        assert!(tower.is_prefill);
        assert_eq!(tower.prompt_mapping, vec![7, 7, 0]);
        // img-1 (3 embeds → 4 rows), img-0 (2 → 3), img-2 (1 → 2).
        assert_eq!(tower.index_mapping, vec![7, 7, 7, 7, 7, 7, 7, 0, 0]);

        let connector = activation.connector.expect("the model has a connector");
        assert_eq!(connector.kind, LoraMappingKind::Connector);
        assert!(connector.is_prefill);
        assert_eq!(connector.prompt_mapping, tower.prompt_mapping);
        // Scheduling order: img-1 (4 + 10 = 14 rows), img-0 (3 + 10 = 13), img-2 (2 + 10 = 12).
        assert_eq!(connector.index_mapping.len(), 39);
        assert!(connector.index_mapping[..14].iter().all(|&id| id == 7));
        assert!(connector.index_mapping[14..27].iter().all(|&id| id == 7));
        assert!(connector.index_mapping[27..].iter().all(|&id| id == 0));
    }

    #[test]
    fn cached_items_items_without_data_and_prompt_embeds_are_skipped() {
        let (mut cache, index, state) = upstream_fixture();
        let features = cache.mm_features.get_mut("req-with-lora").unwrap();
        features.push(image("img-cached", 5, 8));
        features.push(MmFeature {
            modality: Modality::PromptEmbeds,
            ..image("embeds", 13, 6)
        });
        features.push(MmFeature {
            has_data: false,
            ..image("no-data", 19, 5)
        });
        cache.encoder_outputs.insert("img-cached".to_owned());
        let model = MockModel { connector: true };
        let schedule = scheduled(&[("req-with-lora", &[1, 2, 3, 4, 0]), ("req-no-lora", &[0])]);

        let activation = set_active_mm_loras(&model, &cache, &index, &state, &schedule)
            .unwrap()
            .unwrap();

        assert_eq!(activation.tower.prompt_mapping, vec![7, 7, 0]);
        assert_eq!(
            activation.tower.index_mapping,
            [[7; 4].as_slice(), &[7; 3], &[0; 2]].concat()
        );
        assert_eq!(
            activation.connector.unwrap().index_mapping,
            [[7; 14].as_slice(), &[7; 13], &[0; 12]].concat()
        );
    }

    #[test]
    fn is_embed_mask_counts_only_embedded_positions() {
        let mut cache = EncoderCache::default();
        let mut masked = image("img", 0, 6);
        masked.position.is_embed = Some(vec![false, true, true, false, true, false]);
        cache.mm_features.insert("req".to_owned(), vec![masked]);
        let mut state = LoraState::new(1);
        state.add_request("req", 0, Some(vision_lora())).unwrap();
        let index = HashMap::from([("req".to_owned(), 0)]);

        let activation = set_active_mm_loras(
            &QWEN2_VL,
            &cache,
            &index,
            &state,
            &scheduled(&[("req", &[0])]),
        )
        .unwrap()
        .unwrap();

        // 3 embedded positions → 12 tower rows → 3 connector rows.
        assert_eq!(activation.tower.index_mapping, vec![7; 12]);
        assert_eq!(activation.connector.unwrap().index_mapping, vec![7; 3]);
    }

    #[test]
    fn model_without_connector_gets_only_a_tower_mapping() {
        let (cache, index, state) = upstream_fixture();
        let model = MockModel { connector: false };
        let activation = set_active_mm_loras(
            &model,
            &cache,
            &index,
            &state,
            &scheduled(&[("req-with-lora", &[0])]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(activation.tower.index_mapping, vec![7; 3]);
        assert_eq!(activation.connector, None);
    }

    #[test]
    fn nothing_encoded_means_no_activation() {
        let (mut cache, index, state) = upstream_fixture();
        cache.encoder_outputs.insert("img-2".to_owned());
        let model = MockModel { connector: true };
        let none = set_active_mm_loras(
            &model,
            &cache,
            &index,
            &state,
            &scheduled(&[("req-no-lora", &[0]), ("missing-req", &[0])]),
        )
        .unwrap();
        assert_eq!(none, None);
        assert_eq!(
            set_active_mm_loras(&model, &cache, &index, &state, &[]).unwrap(),
            None
        );
    }

    #[test]
    fn requests_without_adapter_add_no_adapter() {
        let (cache, index, state) = upstream_fixture();
        let activation = set_active_mm_loras(
            &MockModel { connector: true },
            &cache,
            &index,
            &state,
            &scheduled(&[("req-no-lora", &[0])]),
        )
        .unwrap()
        .unwrap();
        assert!(activation.adapters.is_empty());
        assert_eq!(activation.tower.index_mapping, vec![0, 0]);
    }

    #[test]
    fn inconsistent_inputs_are_typed_errors() {
        let (cache, index, state) = upstream_fixture();
        let model = MockModel { connector: true };
        assert_eq!(
            set_active_mm_loras(
                &model,
                &cache,
                &index,
                &state,
                &scheduled(&[("req-no-lora", &[3])])
            ),
            Err(MappingError::ItemOutOfRange {
                request: "req-no-lora".to_owned(),
                item: 3,
                available: 1
            })
        );
        let mut far = index.clone();
        far.insert("req-no-lora".to_owned(), 9);
        assert!(matches!(
            set_active_mm_loras(
                &model,
                &cache,
                &far,
                &state,
                &scheduled(&[("req-no-lora", &[0])])
            ),
            Err(MappingError::BatchIndexOutOfRange { index: 9, .. })
        ));
        let mut orphan = index.clone();
        orphan.insert("ghost".to_owned(), 2);
        assert!(matches!(
            set_active_mm_loras(
                &model,
                &cache,
                &orphan,
                &state,
                &scheduled(&[("ghost", &[0])])
            ),
            Err(MappingError::MissingFeatures { .. })
        ));
        // Two requests on one batch index: the id there is not `req-no-lora`'s adapter.
        let mut shared = index.clone();
        shared.insert("req-no-lora".to_owned(), 0);
        assert!(matches!(
            set_active_mm_loras(
                &model,
                &cache,
                &shared,
                &state,
                &scheduled(&[("req-no-lora", &[0])])
            ),
            Err(MappingError::StateMismatch { index: 0, .. })
        ));
        // Another request with another adapter on `req-with-lora`'s index.
        let mut overwritten = state.clone();
        let other = AdapterRequest {
            id: 9,
            ..vision_lora()
        };
        overwritten
            .add_request("req-other", 0, Some(other))
            .unwrap();
        assert!(matches!(
            set_active_mm_loras(
                &model,
                &cache,
                &index,
                &overwritten,
                &scheduled(&[("req-with-lora", &[0])])
            ),
            Err(MappingError::StateMismatch { id: 9, .. })
        ));
        let mut state = LoraState::new(1);
        let zero = AdapterRequest {
            id: NO_ADAPTER,
            ..vision_lora()
        };
        assert!(matches!(
            state.add_request("r", 0, Some(zero)),
            Err(MappingError::ZeroAdapterId { .. })
        ));
    }

    /// A random step: requests with adapter ids (0 = none), items with lengths, and a flag
    /// per item for whether it is cached.
    #[derive(Debug, Clone)]
    struct RandomStep {
        requests: Vec<(AdapterId, Vec<(usize, bool)>)>,
    }

    fn random_step() -> impl Strategy<Value = RandomStep> {
        prop::collection::vec(
            (
                0u64..5,
                prop::collection::vec((1usize..40, prop::bool::weighted(0.2)), 1..5),
            ),
            0..6,
        )
        .prop_map(|requests| RandomStep { requests })
    }

    fn build(
        step: &RandomStep,
    ) -> (
        EncoderCache,
        HashMap<String, usize>,
        LoraState,
        ScheduledEncoderInputs,
    ) {
        let mut cache = EncoderCache::default();
        let mut index = HashMap::new();
        let mut state = LoraState::new(step.requests.len());
        let mut schedule = Vec::new();
        for (r, (adapter, items)) in step.requests.iter().enumerate() {
            let req = format!("req-{r}");
            let features = items
                .iter()
                .enumerate()
                .map(|(i, &(len, _))| image(&format!("{req}-img-{i}"), 0, len))
                .collect();
            for (i, &(_, cached)) in items.iter().enumerate() {
                if cached {
                    cache.encoder_outputs.insert(format!("{req}-img-{i}"));
                }
            }
            cache.mm_features.insert(req.clone(), features);
            let request = (*adapter != NO_ADAPTER).then(|| AdapterRequest {
                name: format!("adapter-{adapter}"),
                id: *adapter,
                path: PathBuf::new(),
            });
            state.add_request(&req, r, request).unwrap();
            index.insert(req.clone(), r);
            // Schedule the items in reverse to exercise scheduling order.
            schedule.push((req, (0..items.len()).rev().collect()));
        }
        (cache, index, state, schedule)
    }

    proptest! {
        #[test]
        fn mappings_follow_scheduling_order_and_request_ids(step in random_step()) {
            let (cache, index, state, schedule) = build(&step);
            let activation =
                set_active_mm_loras(&QWEN2_VL, &cache, &index, &state, &schedule).unwrap();

            // The expected rows, item by item, in scheduling order.
            let mut expected_prompt = Vec::new();
            let mut expected_tower = Vec::new();
            let mut expected_connector = Vec::new();
            let mut expected_adapters = std::collections::BTreeSet::new();
            for (adapter, items) in &step.requests {
                for &(len, cached) in items.iter().rev() {
                    if cached {
                        continue;
                    }
                    expected_prompt.push(*adapter);
                    expected_tower.extend(std::iter::repeat_n(*adapter, len * 4));
                    expected_connector.extend(std::iter::repeat_n(*adapter, len));
                    if *adapter != NO_ADAPTER {
                        expected_adapters.insert(*adapter);
                    }
                }
            }

            match activation {
                None => prop_assert!(expected_prompt.is_empty()),
                Some(activation) => {
                    prop_assert_eq!(&activation.tower.prompt_mapping, &expected_prompt);
                    prop_assert_eq!(&activation.tower.index_mapping, &expected_tower);
                    let connector = activation.connector.unwrap();
                    prop_assert_eq!(&connector.index_mapping, &expected_connector);
                    prop_assert_eq!(connector.index_mapping.len() * 4, activation.tower.index_mapping.len());
                    let ids: Vec<_> = activation.adapters.iter().map(|a| a.id).collect();
                    prop_assert_eq!(ids, expected_adapters.into_iter().collect::<Vec<_>>());
                }
            }
        }
    }
}
