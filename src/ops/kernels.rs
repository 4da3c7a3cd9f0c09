//! Which kernel runs each op on a device: what the engine and the model are given.
//!
//! A user chooses a device and a precision; the kernels follow from them. Each op's rule lives
//! with the op and reads one fact about the device, its [`DeviceClass`]:
//! - the CPU backend runs Flex's matmul and mmlora's own passes;
//! - a software GPU (lavapipe) runs the kernels written and measured for it;
//! - a hardware GPU runs only kernels whose shaders passed their tests on one
//!   (`ops/hardware.rs`), timed per shape where more than one did.
//!
//! [`KernelPins`] overrides that choice for benchmarks and bug reports: `mmlora bench --kernels
//! linear=tiled,shrink=wide`, or the same text in [`ENV`] for any command. A pin opts into a
//! kernel whether or not it has run on hardware.

use std::fmt;
use std::str::FromStr;

use strum::VariantNames;

use crate::ops::attention::AttentionKernel;
use crate::ops::linear::LinearChoice;
use crate::ops::linear::{self, CoopTiling, LinearKernel};
use crate::ops::lora::{LoraKernels, ShrinkKernel};
// The layer norm's and rotary's kernels are fields of `Kernels` (what a tower runs) while those
// ops' modules are the crate's own: named here.
pub use crate::ops::norm::NormKernel;
pub use crate::ops::rotary::RotaryKernel;
use crate::runtime::device::{DeviceClass, Precision, RuntimeDevice};

/// The environment variable that pins kernels for every engine a process opens, as
/// `linear=tiled,shrink=wide`; pins an engine is given name the kernels it leaves unnamed.
pub const ENV: &str = "MMLORA_KERNELS";

/// Kernels pinned by name; `Auto` (the default) leaves an op's choice to its device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelPins {
    /// The linear layers' base products.
    pub linear: LinearKernel,
    /// The LoRA shrink.
    pub shrink: ShrinkKernel,
    /// Attention.
    pub attention: AttentionKernel,
}

/// Why a pin could not be read or cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// A piece of the text is not `op=kernel`.
    #[error("kernel pin {0:?} is not OP=KERNEL (e.g. linear=tiled,shrink=wide)")]
    Malformed(String),
    /// The op is not one that takes a pin.
    #[error("kernel pin {0:?}: no such op (linear, shrink, attention)")]
    UnknownOp(String),
    /// The kernel is not one of the op's.
    #[error("kernel pin {op}={kernel}: no such kernel ({})", .kernels.join(", "))]
    UnknownKernel {
        /// The op.
        op: &'static str,
        /// The name given.
        kernel: String,
        /// The op's kernels.
        kernels: &'static [&'static str],
    },
    /// One op pinned twice.
    #[error("kernel pin {0} is given twice")]
    Repeated(&'static str),
    /// The environment variable holds pins that cannot be read.
    #[error("{ENV}: {0}")]
    Env(Box<KernelError>),
    /// The pinned kernel does not run on the device.
    #[error("the {kernel} {op} kernel {needs}; {device} with {precision} does not offer it")]
    Unsupported {
        /// The op.
        op: &'static str,
        /// The kernel.
        kernel: String,
        /// What it needs.
        needs: String,
        /// The device, in words.
        device: String,
        /// The precision asked for.
        precision: Precision,
    },
}

impl KernelPins {
    /// The pins in [`ENV`]; none pinned where it is unset or empty.
    pub fn from_env() -> Result<Self, KernelError> {
        match std::env::var(ENV) {
            Ok(text) => text.parse().map_err(|e| KernelError::Env(Box::new(e))),
            Err(_) => Ok(Self::default()),
        }
    }

    /// `self`'s pins, and `other`'s for the ops `self` leaves to the device.
    pub fn or(self, other: Self) -> Self {
        fn either<K: Default + PartialEq>(pin: K, other: K) -> K {
            if pin == K::default() { other } else { pin }
        }
        Self {
            linear: either(self.linear, other.linear),
            shrink: either(self.shrink, other.shrink),
            attention: either(self.attention, other.attention),
        }
    }

    /// Refuses a pin `device` cannot run in `precision`.
    pub fn check(self, device: &RuntimeDevice, precision: Precision) -> Result<(), KernelError> {
        let unsupported = |op: &'static str, kernel: &dyn fmt::Display, needs: String| {
            Err(KernelError::Unsupported {
                op,
                kernel: kernel.to_string(),
                needs,
                device: device.description.clone(),
                precision,
            })
        };
        let cpu = device.class() == DeviceClass::Cpu;
        if self.linear.shader().is_some() && cpu {
            return unsupported(
                "linear",
                &self.linear,
                "needs a GPU device (the CPU backend uses Flex's matmul)".to_owned(),
            );
        }
        if let Some(tiling) = self.linear.coop_tiling()
            && (precision != Precision::F16 || linear::coop_subgroup(device, tiling).is_none())
        {
            let subgroups = match tiling {
                CoopTiling::Narrow => "16, 32 or 64",
                CoopTiling::Wide | CoopTiling::Direct => "32",
            };
            return unsupported(
                "linear",
                &self.linear,
                format!(
                    "needs f16 on a GPU with cooperative matrices (16×16×16, f16 summed in f32) \
                     and one subgroup size of {subgroups}"
                ),
            );
        }
        if self.shrink != ShrinkKernel::Auto && cpu {
            return unsupported(
                "LoRA shrink",
                &self.shrink,
                "needs a GPU device (the CPU backend has its own op)".to_owned(),
            );
        }
        Ok(())
    }
}

/// Reads `linear=tiled,shrink=wide,attention=fused`: any of the three ops, each at most once,
/// in any order; the empty text pins nothing.
impl FromStr for KernelPins {
    type Err = KernelError;

    fn from_str(text: &str) -> Result<Self, KernelError> {
        fn kernel<K: FromStr + VariantNames>(
            op: &'static str,
            name: &str,
        ) -> Result<K, KernelError> {
            name.parse().map_err(|_| KernelError::UnknownKernel {
                op,
                kernel: name.to_owned(),
                kernels: K::VARIANTS,
            })
        }
        let mut pins = Self::default();
        let mut named: Vec<&'static str> = Vec::new();
        for piece in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (op, name) = piece
                .split_once('=')
                .ok_or_else(|| KernelError::Malformed(piece.to_owned()))?;
            let (op, name) = (op.trim(), name.trim());
            let op = match op {
                "linear" => {
                    pins.linear = kernel("linear", name)?;
                    "linear"
                }
                "shrink" => {
                    pins.shrink = kernel("shrink", name)?;
                    "shrink"
                }
                "attention" => {
                    pins.attention = kernel("attention", name)?;
                    "attention"
                }
                _ => return Err(KernelError::UnknownOp(op.to_owned())),
            };
            if named.contains(&op) {
                return Err(KernelError::Repeated(op));
            }
            named.push(op);
        }
        Ok(pins)
    }
}

/// The pins as [`FromStr`] reads them, each op not left to the device; `auto` where none is.
impl fmt::Display for KernelPins {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let defaults = Self::default();
        let pins: Vec<String> = [
            (
                "linear",
                self.linear != defaults.linear,
                self.linear.to_string(),
            ),
            (
                "shrink",
                self.shrink != defaults.shrink,
                self.shrink.to_string(),
            ),
            (
                "attention",
                self.attention != defaults.attention,
                self.attention.to_string(),
            ),
        ]
        .into_iter()
        .filter(|&(_, pinned, _)| pinned)
        .map(|(op, _, kernel)| format!("{op}={kernel}"))
        .collect();
        match pins.is_empty() {
            true => f.write_str("auto"),
            false => f.write_str(&pins.join(",")),
        }
    }
}

/// The kernels a model runs on one device in one precision: every op's choice made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    /// The linear layers' base products.
    pub linear: LinearChoice,
    /// The LoRA shrink and expand.
    pub lora: LoraKernels,
    /// Attention (resolved: never `Auto`).
    pub attention: AttentionKernel,
    /// The layer norms.
    pub norm: NormKernel,
    /// Rotary.
    pub rotary: RotaryKernel,
}

/// What every device runs, and a model until it is given its device's kernels: Burn's products
/// and attention, the layer norms from Burn's ops, the backend's own rotary.
impl Default for Kernels {
    fn default() -> Self {
        Self {
            linear: LinearChoice::Fixed(LinearKernel::Burn),
            lora: LoraKernels {
                shrink: ShrinkKernel::Split,
                expand_vec4: true,
            },
            attention: AttentionKernel::Burn,
            norm: NormKernel::Composed,
            rotary: RotaryKernel::Fused,
        }
    }
}

impl Kernels {
    /// The kernels for `device` and `precision`, `pins` pinning some; a pin the device cannot
    /// run is refused.
    pub fn choose(
        pins: KernelPins,
        device: &RuntimeDevice,
        precision: Precision,
    ) -> Result<Self, KernelError> {
        pins.check(device, precision)?;
        Ok(Self {
            linear: LinearChoice::new(pins.linear, device, precision.dtype()),
            lora: LoraKernels::for_device(pins.shrink, device),
            attention: pins.attention.resolve(device),
            norm: NormKernel::for_device(device),
            rotary: RotaryKernel::for_device(device),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::device;

    #[test]
    fn pins_read_back_as_they_print() {
        let pins: KernelPins = " linear=tiled , shrink=wide,attention=fused"
            .parse()
            .unwrap();
        assert_eq!(
            pins,
            KernelPins {
                linear: LinearKernel::Tiled,
                shrink: ShrinkKernel::Wide,
                attention: AttentionKernel::Fused,
            }
        );
        assert_eq!(pins.to_string(), "linear=tiled,shrink=wide,attention=fused");
        assert_eq!(pins.to_string().parse::<KernelPins>().unwrap(), pins);
        let coop: KernelPins = "linear=coop-wide".parse().unwrap();
        assert_eq!(coop.linear, LinearKernel::CoopWide);
        assert_eq!(coop.to_string(), "linear=coop-wide");
        assert_eq!("".parse::<KernelPins>().unwrap(), KernelPins::default());
        assert_eq!(KernelPins::default().to_string(), "auto");
    }

    #[test]
    fn bad_pins_are_named() {
        let error = |text: &str| text.parse::<KernelPins>().unwrap_err().to_string();
        assert_eq!(
            error("linear"),
            "kernel pin \"linear\" is not OP=KERNEL (e.g. linear=tiled,shrink=wide)"
        );
        assert_eq!(
            error("norm=fused"),
            "kernel pin \"norm\": no such op (linear, shrink, attention)"
        );
        assert_eq!(
            error("shrink=fast"),
            "kernel pin shrink=fast: no such kernel (auto, timed, split, wide, registers)"
        );
        assert_eq!(
            error("linear=burn,linear=tiled"),
            "kernel pin linear is given twice"
        );
    }

    #[test]
    fn given_pins_win_over_the_environments() {
        let given: KernelPins = "linear=tiled".parse().unwrap();
        let env: KernelPins = "linear=burn,shrink=wide".parse().unwrap();
        assert_eq!(given.or(env).to_string(), "linear=tiled,shrink=wide");
        assert_eq!(KernelPins::default().or(env), env);
    }

    /// The CPU backend refuses GPU kernels by name, and picks its own for `auto`.
    #[test]
    fn the_cpu_refuses_gpu_pins() {
        let cpu = device::cpu();
        for pins in ["linear=tiled", "shrink=wide", "linear=coop"] {
            let error = Kernels::choose(pins.parse().unwrap(), &cpu, Precision::F32).unwrap_err();
            assert!(
                matches!(&error, KernelError::Unsupported { device, .. } if *device == cpu.description),
                "{pins}: {error}"
            );
        }
        let auto = Kernels::choose(KernelPins::default(), &cpu, Precision::F32).unwrap();
        assert_eq!(auto.linear, LinearChoice::Fixed(LinearKernel::Burn));
        assert_eq!(auto.attention, AttentionKernel::Burn);
        assert_eq!(auto.lora.shrink, ShrinkKernel::Split);
        let attention: KernelPins = "attention=fused".parse().unwrap();
        assert_eq!(
            Kernels::choose(attention, &cpu, Precision::F32)
                .unwrap()
                .attention,
            AttentionKernel::Fused
        );
    }
}
