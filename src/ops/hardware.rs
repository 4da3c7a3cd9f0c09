//! Which of our shaders have run and passed their tests on a real hardware GPU as they are now:
//! the only ones `auto` takes on a user's hardware GPU.
//!
//! Lavapipe runs every shader in CI, but a hardware driver compiles them through another
//! compiler, with other subgroup sizes, memory models and (for the coop kernels) cooperative
//! matrices that CI can only emulate. So a shader joins `auto` on hardware GPUs only once a run
//! of the hardware script (`tools/h200/`) has passed its tests there, and leaves it the moment
//! its text changes: [`CHECKED`] records each checked file's FNV-1a hash as it was in that run,
//! and [`checked`] compares the text compiled into this build. The other kernels stay behind
//! an explicit pin ([`crate::ops::kernels::KernelPins`]; documented in docs/cli.md).
//!
//! What is hashed is the shader file; the Rust side that fills in its template is not, so a
//! change there should be checked on hardware too before it ships.

use crate::runtime::wgsl::ElemShader;

/// A run of the hardware script whose tests passed.
#[derive(Debug)]
#[allow(
    dead_code,
    reason = "the record of a run, for its readers; the tests read the commit"
)]
pub struct HardwareRun {
    /// The commit its binaries were built from.
    pub commit: &'static str,
    /// When.
    pub date: &'static str,
    /// The GPU and driver.
    pub device: &'static str,
    /// The script's test steps that passed, and where their outputs are kept.
    pub tests: &'static str,
}

/// The first H200 run: the op's, the linears' and the engine's tests.
pub const H200_697794E: HardwareRun = HardwareRun {
    commit: "697794e",
    date: "2026-12-04",
    device: "NVIDIA H200, Vulkan, driver 580.159.04",
    tests: "op-tests, linear-tests, engine-tests (docs/h200-2026-12-04/)",
};

/// The second H200 run: the fused attention's tests.
pub const H200_95E0768: HardwareRun = HardwareRun {
    commit: "95e0768",
    date: "2026-12-04",
    device: "NVIDIA H200, Vulkan, driver 580.159.04",
    tests: "attention-tests (docs/h200-2026-12-04-fused/)",
};

/// A shader file checked on hardware: its path under `shaders/` and its text's hash then.
#[derive(Debug)]
#[allow(
    dead_code,
    reason = "`run` is the record of where it passed; the tests read it"
)]
pub struct Checked {
    /// `op/file.wgsl`.
    pub shader: &'static str,
    /// [`fnv1a`] of the file's text in that run.
    pub hash: u64,
    /// The run.
    pub run: &'static HardwareRun,
}

/// Every shader whose current text passed its tests on a hardware GPU. Not here (changed or
/// added since the last hardware run): `linear/linear_tiled.wgsl`, the coop kernels
/// (`linear/linear_coop*.wgsl`), the LoRA epilogue (`linear/linear_lora.wgsl`),
/// `lora/lora_shrink.wgsl` (`split`, `wide`), `lora/lora_expand_vec4.wgsl`,
/// `norm/layer_norm.wgsl` and `rotary/rotary.wgsl`.
pub const CHECKED: &[Checked] = &[
    Checked {
        shader: "linear/linear.wgsl",
        hash: 0x287b_9b0a_2fbb_c4d8,
        run: &H200_697794E,
    },
    Checked {
        shader: "lora/lora_shrink_registers.wgsl",
        hash: 0x08df_47ec_4580_9d54,
        run: &H200_697794E,
    },
    Checked {
        shader: "lora/lora_expand.wgsl",
        hash: 0xb984_07cf_894f_516d,
        run: &H200_697794E,
    },
    Checked {
        shader: "attention/attention.wgsl",
        hash: 0x7f0f_944f_0555_fbb0,
        run: &H200_95E0768,
    },
];

/// The 64-bit FNV-1a hash of `text`'s bytes: enough to tell an edited file from the one that
/// ran (not a defence against a crafted collision, which nothing here needs).
pub const fn fnv1a(text: &str) -> u64 {
    let bytes = text.as_bytes();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    hash
}

/// Whether `source`, the text of `shaders/<shader>` compiled into this build, is one that
/// passed its tests on a hardware GPU.
pub fn checked(shader: &str, source: &str) -> bool {
    let hash = fnv1a(source);
    CHECKED.iter().any(|c| c.shader == shader && c.hash == hash)
}

/// [`checked`] for the one-file kernel `shader` of `op` (`shaders/<op>/<file>`).
pub(crate) fn elem_shader_checked(op: &str, shader: ElemShader) -> bool {
    checked(&format!("{op}/{}", shader.file_name), shader.template)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each entry is its shader's text as it is now: an edit to a checked shader takes it out
    /// of `auto` on hardware GPUs, and this test says so, so that its entry goes too (until
    /// the next hardware run records the new text).
    #[test]
    fn every_entry_is_its_shader_now() {
        for entry in CHECKED {
            let path = format!("{}/shaders/{}", env!("CARGO_MANIFEST_DIR"), entry.shader);
            let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            assert_eq!(
                fnv1a(&text),
                entry.hash,
                "shaders/{} changed since its hardware run ({}): remove its entry, and record it \
                 again from the next hardware run",
                entry.shader,
                entry.run.commit
            );
            assert!(checked(entry.shader, &text));
        }
    }

    /// A linear kernel for hardware GPUs joins `auto` with its LoRA epilogue, since `auto`
    /// times the op fused into it wherever it is picked.
    #[test]
    fn linear_kernels_with_an_epilogue_join_with_it() {
        let has = |shader: &str| CHECKED.iter().any(|c| c.shader == shader);
        let with_epilogue = ["linear/linear_tiled.wgsl", "linear/linear_coop.wgsl"];
        if with_epilogue.iter().any(|s| has(s)) || has("linear/linear_coop_direct.wgsl") {
            assert!(has("linear/linear_lora.wgsl"));
        }
    }

    #[test]
    fn fnv1a_is_the_reference_hash() {
        // FNV-1a's published test vectors.
        assert_eq!(fnv1a(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a("foobar"), 0x8594_4171_f739_67e8);
        assert!(!checked("linear/linear.wgsl", "fn main() {}"));
    }
}
