//! Vision towers and connectors as Burn modules on the runtime device.

pub mod activation;
pub mod checkpoint;
pub mod exp;
pub mod fused_attention;
pub mod fused_norm;
pub mod fused_rotary;
pub mod gemm;
pub mod linear_choice;
pub mod norm;
pub mod qwen2_vl;
pub mod rope;
pub mod sdpa;
pub mod stages;
