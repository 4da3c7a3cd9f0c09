//! The GPU slots: which adapters a step puts in them, which it frees, and restacking the
//! model's LoRA weights when the slots changed.

use std::sync::Arc;

use super::faults::guarded;
use super::{Engine, EngineError};
use crate::adapters::registry::AdapterKey;
use crate::adapters::{PeftAdapter, install};

impl Engine {
    /// The adapter in each GPU slot (by name; `None` for an empty slot or one whose adapter
    /// was unloaded or loaded again since), as the last step left them: a step that needs room
    /// frees the slots whose weights left memory first, then those used least recently.
    pub fn slotted(&self) -> Vec<Option<String>> {
        (0..self.slots.num_slots())
            .map(|slot| {
                let key = self.slots.adapter_in(slot)?;
                self.registry
                    .names()
                    .find(|&name| {
                        self.registry
                            .registration(name)
                            .is_some_and(|r| r.key == key)
                    })
                    .map(str::to_owned)
            })
            .collect()
    }

    /// The adapter key in each GPU slot.
    fn slot_contents(&self) -> Vec<Option<AdapterKey>> {
        (0..self.slots.num_slots())
            .map(|s| self.slots.adapter_in(s))
            .collect()
    }

    /// Puts `wanted` in GPU slots, freeing slots of adapters this step does not use only as
    /// needed, and restacks the model's LoRA weights when the slots changed. A fault while
    /// uploading them is an [`EngineError::Execution`], after which the next step restacks.
    ///
    /// A slot whose weights left memory (unloaded, reloaded or evicted) holds a key no request
    /// asks for again (reading weights back gives a new one), so it is freed first when room
    /// is needed, and when the slots are restacked anyway (its weights cannot be), but not
    /// before: freeing it alone would restack every slot for nothing.
    pub(super) fn activate(&mut self, wanted: &[AdapterKey]) -> Result<(), EngineError> {
        let n = self.slots.num_slots();
        let missing = wanted
            .iter()
            .filter(|&&id| self.slots.slot_of(id).is_none())
            .count();
        let free = (0..n)
            .filter(|&s| self.slots.adapter_in(s).is_none())
            .count();
        // The slots this step does not use: those whose weights left memory first, then the
        // least recently used.
        let mut idle: Vec<(bool, u64, AdapterKey)> = (0..n)
            .filter_map(|s| self.slots.adapter_in(s).map(|id| (s, id)))
            .filter(|(_, id)| !wanted.contains(id))
            .map(|(s, id)| (self.registry.get(id).is_some(), self.slot_used[s], id))
            .collect();
        idle.sort_by_key(|&(in_memory, used, _)| (in_memory, used));
        for (_, _, id) in idle.into_iter().take(missing.saturating_sub(free)) {
            self.slots.deactivate(id);
        }
        self.activations += 1;
        for &id in wanted {
            let slot = self.slots.activate(id)?;
            self.slot_used[slot] = self.activations;
        }
        let current = self.slot_contents();
        if self.stacked.as_ref() != Some(&current) {
            for &id in current.iter().flatten() {
                if self.registry.get(id).is_none() {
                    self.slots.deactivate(id);
                }
            }
            let current = self.slot_contents();
            let adapters: Vec<Option<Arc<PeftAdapter>>> = current
                .iter()
                .map(|id| id.and_then(|id| self.registry.get(id).cloned()))
                .collect();
            // Stacks as deep as the last slot taken: slots fill from the first, so a few
            // adapters in many slots stack a few (the op checks each row's slot against it).
            let taken = adapters
                .iter()
                .rposition(Option::is_some)
                .map_or(0, |s| s + 1);
            let slotted: Vec<Option<&PeftAdapter>> =
                adapters[..taken].iter().map(|a| a.as_deref()).collect();
            self.stacked = None;
            guarded(|| {
                install(self.model.as_mut(), &slotted, &self.device.device);
                Ok(())
            })?;
            tracing::debug!(slots = ?current, "adapters restacked");
            self.stacked = Some(current);
        }
        Ok(())
    }
}
