//! What every op runs on: the device and its backend, the one path our WGSL kernels launch
//! through, Flex tensors' memory for the CPU ops, and the clocks that time kernels and stages.

pub mod device;
pub(crate) mod exp;
pub(crate) mod flex;
pub mod progress;
pub(crate) mod stages;
pub(crate) mod timing;
pub(crate) mod tuner;
pub(crate) mod wgsl;
