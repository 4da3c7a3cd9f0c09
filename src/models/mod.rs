//! Vision towers and connectors, and the checkpoints they load from.

pub mod checkpoint;
pub mod qwen2_vl;
