// Each test crate uses only part of this module.
#![allow(dead_code)]

//! Shared by the integration tests: the fixtures under `assets/tiny-qwen2-vl/` written by
//! `tools/make_fixtures.py` with transformers + PEFT.

use std::path::PathBuf;

use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

/// The fixture model folder.
pub fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-qwen2-vl")
}

/// One request of the fixture's mixed batch.
#[derive(Debug, Clone, Deserialize)]
pub struct FixtureRequest {
    /// `request{i}`: the key prefix of its expected outputs.
    pub id: String,
    /// Image path relative to the fixture folder.
    pub image: String,
    /// Adapter folder name under `adapters/`, or none.
    pub adapter: Option<String>,
}

#[derive(Deserialize)]
struct BatchFile {
    requests: Vec<FixtureRequest>,
}

/// The mixed batch the fixtures were made for (`batch.json`, in `mmlora encode --batch` form).
pub fn requests() -> Vec<FixtureRequest> {
    let text = std::fs::read_to_string(fixture_dir().join("batch.json")).unwrap();
    serde_json::from_str::<BatchFile>(&text).unwrap().requests
}

/// The reference outputs.
pub struct Expected {
    bytes: Vec<u8>,
}

impl Expected {
    pub fn load() -> Self {
        Self {
            bytes: std::fs::read(fixture_dir().join("expected.safetensors")).unwrap(),
        }
    }

    /// A float tensor's values and shape.
    pub fn f32(&self, name: &str) -> (Vec<f32>, Vec<usize>) {
        let tensors = SafeTensors::deserialize(&self.bytes).unwrap();
        let view = tensors
            .tensor(name)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(view.dtype(), Dtype::F32, "{name}");
        let values = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        (values, view.shape().to_vec())
    }

    /// An int64 tensor's values.
    pub fn i64(&self, name: &str) -> Vec<i64> {
        let tensors = SafeTensors::deserialize(&self.bytes).unwrap();
        let view = tensors
            .tensor(name)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(view.dtype(), Dtype::I64, "{name}");
        view.data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }
}

/// Relative Frobenius error of `actual` against `expected`, and the max abs error.
pub fn errors<A: Copy + Into<f64>>(actual: &[A], expected: &[f32]) -> (f64, f64) {
    assert_eq!(actual.len(), expected.len());
    let (mut diff, mut norm, mut worst) = (0.0f64, 0.0f64, 0.0f64);
    for (&a, &e) in actual.iter().zip(expected) {
        let d = a.into() - f64::from(e);
        diff += d * d;
        norm += f64::from(e).powi(2);
        worst = worst.max(d.abs());
    }
    ((diff / norm).sqrt(), worst)
}
