//! The layers models are written in, built from [`crate::ops`].

mod lora_linear;

pub use lora_linear::LoraLinear;
