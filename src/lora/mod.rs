//! Multi-LoRA execution: kernel metadata and the LoRA-apply op.

pub mod linear;
pub mod meta;
pub mod ops;
