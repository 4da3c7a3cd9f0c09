//! mmlora: the vision tower and connector of a vision-language model with many LoRA adapters in
//! one batch, on any GPU wgpu reaches and on the CPU.
//!
//! The modules follow the data flow of one batch (see `DESIGN.md`):
//! requests → [`mapping`] (which adapter each tower/connector row belongs to) →
//! [`lora::meta`] (rows grouped by adapter slot) → [`lora::ops`] (each row's LoRA delta, on the
//! CPU backend or in our WGSL kernels). [`device`] picks the backend; [`wgsl`] launches our
//! kernels on it; [`timing`] times the candidates of the kernels picked by measurement.

pub mod adapters;
pub mod bench;
pub mod device;
pub mod engine;
pub mod files;
#[doc(hidden)]
pub mod fuzzing;
pub mod lora;
pub mod mapping;
pub mod model;
pub mod preprocess;
pub mod timing;
pub mod wgsl;
