//! Multi-LoRA execution: kernel metadata and the LoRA-apply op.

pub mod meta;
pub mod ops;
