//! What every op runs on: the device and its backend, the one path our WGSL kernels launch
//! through, Flex tensors' memory for the CPU ops, and the clocks that time kernels and stages.

pub mod device;
pub mod exp;
pub mod flex;
pub mod progress;
pub mod stages;
pub mod timing;
pub mod tuner;
pub mod wgsl;
