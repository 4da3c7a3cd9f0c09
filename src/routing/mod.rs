//! Which adapter each row of a batch belongs to: bookkeeping only, no tensors and no devices.
//!
//! [`mapping`] builds the per-row adapter ids from the scheduled requests (vLLM's
//! `set_active_mm_loras`); [`meta`] turns them into the slot-grouped rows the LoRA op walks
//! (Punica's kernel metadata).

pub mod mapping;
pub mod meta;
