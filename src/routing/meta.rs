//! Kernel metadata: from a mapping of adapter ids to the per-slot row groups the LoRA op walks.
//!
//! Punica/vLLM `LoRAKernelMeta` semantics (ARCHITECTURE.md, "The rules the routing keeps"): adapter
//! ids become slot indices through the [`SlotTable`] (id 0 → [`NO_SLOT`]); rows are stable-sorted
//! by slot; each active slot gets its row count and a start offset into the sorted order (with a
//! leading 0); a batch where every row is [`NO_SLOT`] carries the no-LoRA flag.

use std::num::NonZeroUsize;

use crate::routing::mapping::{AdapterId, LoraMapping, MAX_ROWS, NO_ADAPTER};

/// The slot of rows that use no adapter.
pub const NO_SLOT: i32 = -1;

/// Errors building slot tables and kernel metadata.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetaError {
    /// A step needs more distinct adapters than there are slots.
    #[error("{distinct} distinct adapters need slots but only {slots} exist (max_loras)")]
    TooManyAdapters {
        /// Distinct adapters requested.
        distinct: usize,
        /// Slots available.
        slots: usize,
    },
    /// A mapping names an adapter that holds no slot.
    #[error("adapter id {id} is not active in any slot")]
    AdapterNotActive {
        /// The adapter id.
        id: AdapterId,
    },
    /// Every slot is taken, and `id` needs one.
    #[error("adapter id {id} needs a slot but all {slots} are taken (max_loras)")]
    NoFreeSlot {
        /// The adapter id.
        id: AdapterId,
        /// Slots available.
        slots: usize,
    },
    /// More rows than the kernels index (they address rows with 32-bit signed integers).
    #[error("{rows} rows are more than the LoRA kernels index ({})", MAX_ROWS)]
    TooManyRows {
        /// The rows given.
        rows: usize,
    },
    /// A row's slot is neither [`NO_SLOT`] nor below the slot count.
    #[error("row {row} has slot {slot}, outside -1..{slots}")]
    SlotOutOfRange {
        /// The row.
        row: usize,
        /// Its slot.
        slot: i32,
        /// The slot count.
        slots: usize,
    },
    /// A reordering of the rows names a row twice, or one that is not there.
    #[error("a reordering of {rows} rows is not a permutation of them")]
    NotAPermutation {
        /// The rows.
        rows: usize,
    },
}

/// Which adapter occupies each of the `max_loras` slots (vLLM's `lora_index_to_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotTable {
    slots: Vec<Option<AdapterId>>,
}

impl SlotTable {
    /// A table of `max_loras` empty slots.
    pub fn new(max_loras: usize) -> Self {
        Self {
            slots: vec![None; max_loras],
        }
    }

    /// A table holding exactly `ids` (id 0 ignored, duplicates once), in first-seen order.
    pub fn for_adapters(
        ids: impl IntoIterator<Item = AdapterId>,
        max_loras: usize,
    ) -> Result<Self, MetaError> {
        let mut distinct: Vec<AdapterId> = Vec::new();
        for id in ids {
            if id != NO_ADAPTER && !distinct.contains(&id) {
                distinct.push(id);
            }
        }
        if distinct.len() > max_loras {
            return Err(MetaError::TooManyAdapters {
                distinct: distinct.len(),
                slots: max_loras,
            });
        }
        let mut table = Self::new(max_loras);
        for (slot, id) in distinct.into_iter().enumerate() {
            table.slots[slot] = Some(id);
        }
        Ok(table)
    }

    /// Puts `id` in the first free slot (or returns the slot it already holds).
    pub fn activate(&mut self, id: AdapterId) -> Result<usize, MetaError> {
        if let Some(slot) = self.slot_of(id) {
            return Ok(slot);
        }
        let free = self
            .slots
            .iter()
            .position(Option::is_none)
            .ok_or(MetaError::NoFreeSlot {
                id,
                slots: self.slots.len(),
            })?;
        self.slots[free] = Some(id);
        Ok(free)
    }

    /// Frees the slot `id` holds, if any.
    pub fn deactivate(&mut self, id: AdapterId) {
        for slot in &mut self.slots {
            if *slot == Some(id) {
                *slot = None;
            }
        }
    }

    /// The slot holding `id`.
    pub fn slot_of(&self, id: AdapterId) -> Option<usize> {
        self.slots.iter().position(|&s| s == Some(id))
    }

    /// The adapter in `slot`.
    pub fn adapter_in(&self, slot: usize) -> Option<AdapterId> {
        self.slots.get(slot).copied().flatten()
    }

    /// The number of slots (`max_loras`).
    pub fn num_slots(&self) -> usize {
        self.slots.len()
    }
}

/// Per-row slots grouped for the kernels (vLLM's `LoRAKernelMeta`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelMeta {
    token_slots: Vec<i32>,
    sorted_tokens: Vec<u32>,
    active_slots: Vec<i32>,
    tokens_per_slot: Vec<u32>,
    segment_starts: Vec<u32>,
    num_slots: usize,
}

/// A run of rows, consecutive in the sorted order, that share one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// The slot ([`NO_SLOT`] for rows without adapter).
    pub slot: i32,
    /// First position in [`KernelMeta::sorted_tokens`].
    pub start: usize,
    /// Number of rows.
    pub len: usize,
}

impl KernelMeta {
    /// Metadata for `mapping`, with ids resolved through `table`.
    pub fn from_mapping(mapping: &LoraMapping, table: &SlotTable) -> Result<Self, MetaError> {
        let mut distinct: Vec<AdapterId> = Vec::new();
        for &id in &mapping.index_mapping {
            if id != NO_ADAPTER && !distinct.contains(&id) {
                distinct.push(id);
            }
        }
        if distinct.len() > table.num_slots() {
            return Err(MetaError::TooManyAdapters {
                distinct: distinct.len(),
                slots: table.num_slots(),
            });
        }
        let token_slots = mapping
            .index_mapping
            .iter()
            .map(|&id| match id {
                NO_ADAPTER => Ok(NO_SLOT),
                id => table
                    .slot_of(id)
                    .map(|slot| slot as i32)
                    .ok_or(MetaError::AdapterNotActive { id }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::from_token_slots(token_slots, table.num_slots())
    }

    /// Metadata for rows whose slots are given directly (each [`NO_SLOT`] or below `num_slots`),
    /// at most [`MAX_ROWS`] of them.
    pub fn from_token_slots(token_slots: Vec<i32>, num_slots: usize) -> Result<Self, MetaError> {
        if token_slots.len() > MAX_ROWS {
            return Err(MetaError::TooManyRows {
                rows: token_slots.len(),
            });
        }
        let in_range =
            |slot: i32| slot == NO_SLOT || usize::try_from(slot).is_ok_and(|s| s < num_slots);
        if let Some((row, &slot)) = token_slots
            .iter()
            .enumerate()
            .find(|&(_, &slot)| !in_range(slot))
        {
            return Err(MetaError::SlotOutOfRange {
                row,
                slot,
                slots: num_slots,
            });
        }
        let mut sorted_tokens: Vec<u32> = (0..token_slots.len() as u32).collect();
        sorted_tokens.sort_by_key(|&row| token_slots[row as usize]); // stable
        let mut active_slots = Vec::new();
        let mut tokens_per_slot: Vec<u32> = Vec::new();
        for &row in &sorted_tokens {
            let slot = token_slots[row as usize];
            if active_slots.last() == Some(&slot) {
                *tokens_per_slot.last_mut().expect("pushed with the slot") += 1;
            } else {
                active_slots.push(slot);
                tokens_per_slot.push(1);
            }
        }
        let segment_starts = std::iter::once(0)
            .chain(tokens_per_slot.iter().scan(0, |end, &count| {
                *end += count;
                Some(*end)
            }))
            .collect();
        Ok(Self {
            token_slots,
            sorted_tokens,
            active_slots,
            tokens_per_slot,
            segment_starts,
            num_slots,
        })
    }

    /// The slot of each row, in row order.
    pub fn token_slots(&self) -> &[i32] {
        &self.token_slots
    }

    /// Row indices stable-sorted by slot (vLLM's `token_indices_sorted_by_lora_ids`).
    pub fn sorted_tokens(&self) -> &[u32] {
        &self.sorted_tokens
    }

    /// The slots present, ascending ([`NO_SLOT`] first when present).
    pub fn active_slots(&self) -> &[i32] {
        &self.active_slots
    }

    /// Rows per active slot (vLLM's `num_tokens_per_lora`).
    pub fn tokens_per_slot(&self) -> &[u32] {
        &self.tokens_per_slot
    }

    /// Start of each active slot's rows in the sorted order, with a leading 0 and the row count
    /// last (vLLM's `lora_token_start_loc`).
    pub fn segment_starts(&self) -> &[u32] {
        &self.segment_starts
    }

    /// Whether no row uses an adapter (the LoRA op then does nothing).
    pub fn no_lora(&self) -> bool {
        self.active_slots.iter().all(|&slot| slot == NO_SLOT)
    }

    /// The number of rows.
    pub fn num_tokens(&self) -> usize {
        self.token_slots.len()
    }

    /// The number of slots the metadata was built for.
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// The metadata of these rows reordered: row `i` of the result is row `order[i]` here, with
    /// its slot (a tower that permutes its rows, as window attention does, keeps each row's
    /// adapter). `order` must be a permutation of the rows.
    pub fn permuted(&self, order: &[usize]) -> Result<Self, MetaError> {
        let rows = self.token_slots.len();
        let mut seen = vec![false; rows];
        let is_permutation = order.len() == rows
            && order
                .iter()
                .all(|&row| row < rows && !std::mem::replace(&mut seen[row], true));
        if !is_permutation {
            return Err(MetaError::NotAPermutation { rows });
        }
        let slots = order.iter().map(|&row| self.token_slots[row]).collect();
        Self::from_token_slots(slots, self.num_slots)
    }

    /// The row groups that use an adapter, in sorted order.
    pub fn lora_segments(&self) -> impl Iterator<Item = Segment> + '_ {
        self.active_slots
            .iter()
            .enumerate()
            .filter(|&(_, &slot)| slot != NO_SLOT)
            .map(|(i, &slot)| Segment {
                slot,
                start: self.segment_starts[i] as usize,
                len: self.tokens_per_slot[i] as usize,
            })
    }

    /// The adapter-using segments cut into tiles of at most `rows` rows each.
    pub fn tiles(&self, rows: NonZeroUsize) -> impl Iterator<Item = Segment> + '_ {
        let rows = rows.get();
        self.lora_segments().flat_map(move |segment| {
            (0..segment.len).step_by(rows).map(move |offset| Segment {
                slot: segment.slot,
                start: segment.start + offset,
                len: rows.min(segment.len - offset),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::mapping::LoraMappingKind;
    use proptest::prelude::*;

    /// A permuted row keeps its slot; anything but a permutation is refused.
    #[test]
    fn permuted_rows_keep_their_slots() {
        let meta = KernelMeta::from_token_slots(vec![0, NO_SLOT, 1, 0, 2], 3).unwrap();
        let order = [4, 2, 0, 3, 1];
        let permuted = meta.permuted(&order).unwrap();
        assert_eq!(permuted.token_slots(), [2, 1, 0, 0, NO_SLOT]);
        assert_eq!(permuted.num_slots(), 3);
        let back: Vec<usize> = (0..5)
            .map(|row| order.iter().position(|&o| o == row).unwrap())
            .collect();
        assert_eq!(
            permuted.permuted(&back).unwrap().token_slots(),
            meta.token_slots()
        );
        for bad in [
            &[0, 1, 2, 3][..],
            &[0, 1, 2, 3, 3],
            &[0, 1, 2, 3, 5],
            &[0, 1, 2, 3, 4, 0],
        ] {
            assert_eq!(
                meta.permuted(bad).unwrap_err(),
                MetaError::NotAPermutation { rows: 5 },
                "{bad:?}"
            );
        }
    }

    /// vLLM's `LoRAKernelMeta` docstring example with `max_loras = 3`: counts `[3, 10, 5, 2]` and
    /// start offsets `[0, 3, 13, 18, 20]`. Upstream lists the ids as `[-1, 0, 2, 1]` to show the
    /// buffer's layout; `torch.unique(sorted=True)` (and this port) returns them ascending, so the
    /// input below puts 5 rows on slot 1 and 2 on slot 2, interleaved.
    #[test]
    fn upstream_docstring_example() {
        let mut slots = Vec::new();
        slots.extend([NO_SLOT; 3]);
        slots.extend([0; 10]);
        slots.extend([1; 5]);
        slots.extend([2; 2]);
        // Interleave deterministically so the sort has work to do.
        let interleaved: Vec<i32> = (0..slots.len())
            .map(|i| slots[(i * 7) % slots.len()])
            .collect();
        let meta = KernelMeta::from_token_slots(interleaved.clone(), 3).unwrap();

        assert_eq!(meta.active_slots(), &[-1, 0, 1, 2]);
        assert_eq!(meta.tokens_per_slot(), &[3, 10, 5, 2]);
        assert_eq!(meta.segment_starts(), &[0, 3, 13, 18, 20]);
        assert!(!meta.no_lora());
        // Sorted rows are grouped by slot and stable within a slot.
        let sorted_slots: Vec<i32> = meta
            .sorted_tokens()
            .iter()
            .map(|&row| interleaved[row as usize])
            .collect();
        assert_eq!(sorted_slots, slots);
        for window in meta.sorted_tokens().windows(2) {
            let (a, b) = (window[0] as usize, window[1] as usize);
            if interleaved[a] == interleaved[b] {
                assert!(a < b, "stable sort keeps row order within a slot");
            }
        }
    }

    #[test]
    fn all_rows_without_adapter_set_the_no_lora_flag() {
        let meta = KernelMeta::from_token_slots(vec![NO_SLOT; 5], 2).unwrap();
        assert!(meta.no_lora());
        assert_eq!(meta.active_slots(), &[NO_SLOT]);
        assert_eq!(meta.segment_starts(), &[0, 5]);
        assert_eq!(meta.lora_segments().count(), 0);
        let empty = KernelMeta::from_token_slots(vec![], 2).unwrap();
        assert!(empty.no_lora());
        assert_eq!(empty.segment_starts(), &[0]);
    }

    #[test]
    fn mapping_ids_resolve_through_the_slot_table() {
        let table = SlotTable::for_adapters([9, 0, 4, 9], 3).unwrap();
        assert_eq!(table.slot_of(9), Some(0));
        assert_eq!(table.slot_of(4), Some(1));
        assert_eq!(table.adapter_in(2), None);
        let mapping = LoraMapping {
            kind: LoraMappingKind::Tower,
            index_mapping: vec![4, 0, 9, 4, 0],
            prompt_mapping: vec![4, 0, 9],
            is_prefill: true,
        };
        let meta = KernelMeta::from_mapping(&mapping, &table).unwrap();
        assert_eq!(meta.token_slots(), &[1, -1, 0, 1, -1]);
        assert_eq!(meta.sorted_tokens(), &[1, 4, 2, 0, 3]);
        assert_eq!(meta.active_slots(), &[-1, 0, 1]);
        assert_eq!(meta.segment_starts(), &[0, 2, 3, 5]);
    }

    #[test]
    fn more_distinct_adapters_than_slots_is_an_error() {
        assert_eq!(
            SlotTable::for_adapters([1, 2, 3], 2),
            Err(MetaError::TooManyAdapters {
                distinct: 3,
                slots: 2
            })
        );
        let mut table = SlotTable::new(1);
        assert_eq!(table.activate(5), Ok(0));
        assert_eq!(table.activate(5), Ok(0));
        assert_eq!(
            table.activate(6),
            Err(MetaError::NoFreeSlot { id: 6, slots: 1 })
        );
        table.deactivate(5);
        assert_eq!(table.activate(6), Ok(0));

        let mapping = LoraMapping {
            kind: LoraMappingKind::Connector,
            index_mapping: vec![1, 2],
            prompt_mapping: vec![1, 2],
            is_prefill: true,
        };
        assert_eq!(
            KernelMeta::from_mapping(&mapping, &table),
            Err(MetaError::TooManyAdapters {
                distinct: 2,
                slots: 1
            })
        );
        let single = LoraMapping {
            index_mapping: vec![3],
            ..mapping
        };
        assert_eq!(
            KernelMeta::from_mapping(&single, &table),
            Err(MetaError::AdapterNotActive { id: 3 })
        );
    }

    #[test]
    fn slots_out_of_range_are_rejected() {
        assert_eq!(
            KernelMeta::from_token_slots(vec![0, 2], 2),
            Err(MetaError::SlotOutOfRange {
                row: 1,
                slot: 2,
                slots: 2
            })
        );
        assert!(KernelMeta::from_token_slots(vec![-2], 2).is_err());
        // A slot count past i32 (it wrapped to a negative bound, refusing every slot).
        let meta = KernelMeta::from_token_slots(vec![5, NO_SLOT], 1 << 31).unwrap();
        assert_eq!(meta.active_slots(), &[NO_SLOT, 5]);
    }

    #[test]
    fn tiles_cut_segments_without_crossing_slots() {
        let slots = [vec![NO_SLOT; 4], vec![0; 5], vec![1; 2]].concat();
        let meta = KernelMeta::from_token_slots(slots, 2).unwrap();
        let tiles: Vec<_> = meta.tiles(NonZeroUsize::new(2).unwrap()).collect();
        let expect = |slot, start, len| Segment { slot, start, len };
        assert_eq!(
            tiles,
            vec![
                expect(0, 4, 2),
                expect(0, 6, 2),
                expect(0, 8, 1),
                expect(1, 9, 2)
            ]
        );
    }

    proptest! {
        #[test]
        fn segments_partition_the_sorted_rows(
            slots in prop::collection::vec(-1i32..6, 0..300),
        ) {
            let meta = KernelMeta::from_token_slots(slots.clone(), 6).unwrap();
            let starts = meta.segment_starts();
            prop_assert_eq!(starts[0], 0);
            prop_assert_eq!(*starts.last().unwrap() as usize, slots.len());
            prop_assert_eq!(meta.active_slots().len() + 1, starts.len());
            prop_assert!(meta.active_slots().windows(2).all(|w| w[0] < w[1]));
            let mut rows: Vec<u32> = meta.sorted_tokens().to_vec();
            for (i, &slot) in meta.active_slots().iter().enumerate() {
                let segment = &meta.sorted_tokens()[starts[i] as usize..starts[i + 1] as usize];
                prop_assert_eq!(segment.len(), meta.tokens_per_slot()[i] as usize);
                prop_assert!(segment.iter().all(|&row| slots[row as usize] == slot));
                prop_assert!(segment.windows(2).all(|w| w[0] < w[1]));
            }
            rows.sort_unstable();
            prop_assert_eq!(rows, (0..slots.len() as u32).collect::<Vec<_>>());
            prop_assert_eq!(meta.no_lora(), slots.iter().all(|&s| s == NO_SLOT));
            let tiled: usize = meta.tiles(NonZeroUsize::new(16).unwrap()).map(|tile| tile.len).sum();
            prop_assert_eq!(tiled, slots.iter().filter(|&&s| s != NO_SLOT).count());
        }
    }
}
