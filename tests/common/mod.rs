// Each test crate uses only part of this module.
#![allow(dead_code)]

//! Shared by the integration tests: the fixtures under `assets/tiny-qwen2-vl/` (and each
//! other family's `assets/tiny-<family>/`) written by `tools/make_fixtures.py` with
//! transformers + PEFT.

use std::path::PathBuf;

use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

/// The fixture model folder.
pub fn fixture_dir() -> PathBuf {
    family_dir("qwen2-vl")
}

/// The fixture model folder of `family` (`qwen2-vl`, `qwen2.5-vl`, `qwen3-vl`).
pub fn family_dir(family: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("assets/tiny-{family}"))
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
    /// Adapter name → folder, relative to the file.
    adapters: std::collections::BTreeMap<String, String>,
    requests: Vec<FixtureRequest>,
}

fn batch_file(dir: &std::path::Path) -> BatchFile {
    let text = std::fs::read_to_string(dir.join("batch.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The mixed batch the fixtures were made for (`batch.json`, in `mmlora encode --batch` form).
pub fn requests() -> Vec<FixtureRequest> {
    requests_in(&fixture_dir())
}

/// The mixed batch of the fixture folder `dir`.
pub fn requests_in(dir: &std::path::Path) -> Vec<FixtureRequest> {
    batch_file(dir).requests
}

/// The adapters of the fixture folder `dir`'s batch: name and folder.
pub fn adapters_in(dir: &std::path::Path) -> Vec<(String, PathBuf)> {
    batch_file(dir)
        .adapters
        .into_iter()
        .map(|(name, folder)| (name, dir.join(folder)))
        .collect()
}

/// The fixture folder `dir`'s model on `on` with every adapter of its batch loaded.
pub fn family_engine(
    dir: &std::path::Path,
    on: &mmlora::runtime::device::RuntimeDevice,
) -> mmlora::engine::Engine {
    let options = mmlora::engine::EngineOptions::default();
    let mut engine = mmlora::engine::Engine::open(dir, on.clone(), options).unwrap();
    for (name, folder) in adapters_in(dir) {
        engine.load_adapter(&name, &folder).unwrap();
    }
    engine
}

/// The mixed batch of the fixture folder `dir` (and its patches of two frames) in one call on
/// the CPU backend: every request matches transformers + PEFT run request by request, and
/// each image request equals itself run alone.
pub fn mixed_batch_matches_peft_on_the_cpu(dir: &std::path::Path) {
    let cpu = mmlora::runtime::device::cpu();
    let expected = Expected::load_from(dir);
    let requests = requests_with_frames(dir);
    let mut engine = family_engine(dir, &cpu);
    let results = engine.encode(&requests, true).unwrap();
    assert!(results.iter().all(|r| r.step == 0), "one step fits all");
    // Tolerance: rel. Frobenius 1e-5, max abs 1e-4 (the model issue's bounds).
    assert_outputs_match(&results, &expected, 1e-5, &cpu.description);
    // Each image request alone (the random patches of the two frames, far from normalised
    // pixels, move by 1.02e-6 alone on Qwen2.5-VL).
    let images = requests.len() - 1;
    for (request, mixed) in requests.iter().zip(&results).take(images) {
        let alone = engine.encode(std::slice::from_ref(request), true).unwrap();
        let alone = &alone[0];
        for (name, alone, mixed) in [
            ("embeds", Some(&alone.embeds), Some(&mixed.embeds)),
            ("tower", alone.tower.as_ref(), mixed.tower.as_ref()),
            (
                "deepstack",
                alone.deepstack.as_ref(),
                mixed.deepstack.as_ref(),
            ),
        ] {
            assert_eq!(alone.is_some(), mixed.is_some(), "{} {name}", request.id);
            let (Some(alone), Some(mixed)) = (alone, mixed) else {
                continue;
            };
            let (rel, _) = errors(&alone.values, &mixed.values);
            // Tolerance: 1e-6 relative; the same rows through the same kernels, only the
            // other rows of the matmuls differ.
            assert!(
                rel <= 1e-6,
                "{} {name} alone against mixed: rel {rel:e}",
                request.id
            );
        }
    }
}

/// The adapter folder `adapter` on the model folder `model` (on the CPU backend) is refused,
/// naming its weights file and a module the model lacks; the engine is left without adapters.
/// Returns that module.
pub fn assert_refused_by_module(model: &std::path::Path, adapter: &std::path::Path) -> String {
    let cpu = mmlora::runtime::device::cpu();
    let options = mmlora::engine::EngineOptions::default();
    let mut engine = mmlora::engine::Engine::open(model, cpu, options).unwrap();
    let error = engine
        .load_adapter("other", adapter)
        .unwrap_err()
        .to_string();
    let says = " is not a LoRA target of this model";
    assert!(
        error.contains("adapter_model.safetensors") && error.ends_with(says),
        "{error}"
    );
    // The module named (the first key in name order that the model lacks).
    let module = error[..error.len() - says.len()]
        .trim_end_matches('`')
        .rsplit('`')
        .next()
        .unwrap()
        .to_owned();
    let targets = engine.model().lora_targets();
    assert!(
        !targets.iter().any(|t| t.path == module),
        "{module}: {error}"
    );
    assert!(engine.adapter_names().is_empty());
    module
}

/// The same batch on wgpu with the device's default kernels, against transformers + PEFT.
pub fn mixed_batch_matches_peft_on_wgpu(dir: &std::path::Path) {
    let Some(gpu) = mmlora::runtime::device::gpu_for_tests() else {
        return;
    };
    let expected = Expected::load_from(dir);
    let results = family_engine(dir, &gpu)
        .encode(&requests_with_frames(dir), true)
        .unwrap();
    // Tolerance: rel. Frobenius 1e-4 (GPU summation order), max abs 1e-4.
    assert_outputs_match(&results, &expected, 1e-4, &gpu.description);
}

/// The fixture's requests as engine requests, their images given as files.
pub fn fixture_requests() -> Vec<mmlora::engine::Request> {
    fixture_requests_in(&fixture_dir())
}

/// The requests of the fixture folder `dir`, their images given as files.
pub fn fixture_requests_in(dir: &std::path::Path) -> Vec<mmlora::engine::Request> {
    requests_in(dir)
        .into_iter()
        .map(|r| mmlora::engine::Request {
            image: mmlora::engine::ImageSource::File(dir.join(&r.image)),
            id: r.id,
            adapter: r.adapter,
        })
        .collect()
}

/// The requests of the fixture folder `dir` and, after them, its patches of two frames (grid
/// t = 2, as a video's: each frame attends within itself and takes the rotary table again)
/// with all-r4.
pub fn requests_with_frames(dir: &std::path::Path) -> Vec<mmlora::engine::Request> {
    let expected = Expected::load_from(dir);
    let (pixel_values, _) = expected.f32("frames.pixel_values");
    let grid = expected.i64("frames.image_grid_thw");
    let mut requests = fixture_requests_in(dir);
    requests.push(mmlora::engine::Request {
        id: "frames".to_owned(),
        image: mmlora::engine::ImageSource::Patches(mmlora::preprocess::Patches {
            pixel_values,
            grid_thw: [0, 1, 2].map(|i| grid[i] as usize),
        }),
        adapter: Some("all-r4".to_owned()),
    });
    requests
}

/// The key of `file`'s pixel values from `backend` in the reference outputs (the request
/// outputs were computed from torchvision's, transformers 5's default).
pub fn pixel_values_key(file: &str, backend: mmlora::preprocess::ImageBackend) -> String {
    match backend {
        mmlora::preprocess::ImageBackend::Torchvision => format!("{file}.pixel_values"),
        mmlora::preprocess::ImageBackend::Pil => format!("{file}.pil.pixel_values"),
    }
}

/// The reference outputs.
pub struct Expected {
    bytes: Vec<u8>,
}

impl Expected {
    pub fn load() -> Self {
        Self::load_from(&fixture_dir())
    }

    /// The reference outputs of the fixture folder `dir`.
    pub fn load_from(dir: &std::path::Path) -> Self {
        Self {
            bytes: std::fs::read(dir.join("expected.safetensors")).unwrap(),
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

    /// Whether the outputs hold `name`.
    pub fn has(&self, name: &str) -> bool {
        let tensors = SafeTensors::deserialize(&self.bytes).unwrap();
        tensors.names().contains(&name)
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

/// Each result's tower, embeddings and (where the reference has them) deepstack outputs
/// against the reference outputs: within `rel_tol` in relative Frobenius norm and 1e-4 at
/// worst, shapes equal; a result has deepstack outputs exactly where the reference does.
pub fn assert_outputs_match(
    results: &[mmlora::engine::Encoded],
    expected: &Expected,
    rel_tol: f64,
    on: &str,
) {
    for result in results {
        let tower = result.tower.as_ref().expect("asked for the tower");
        let deepstack = format!("{}.deepstack", result.id);
        assert_eq!(
            result.deepstack.is_some(),
            expected.has(&deepstack),
            "{deepstack} on {on}"
        );
        let outputs = [
            ("tower", Some(tower)),
            ("embeds", Some(&result.embeds)),
            ("deepstack", result.deepstack.as_ref()),
        ];
        for (name, actual) in outputs {
            let Some(actual) = actual else { continue };
            let (want, shape) = expected.f32(&format!("{}.{name}", result.id));
            assert_eq!(
                actual.shape.as_slice(),
                shape.as_slice(),
                "{} {name}",
                result.id
            );
            let (rel, worst) = errors(&actual.values, &want);
            assert!(
                rel <= rel_tol && worst <= 1e-4,
                "{} ({:?}) {name} on {on}: rel {rel:e}, max {worst:e}",
                result.id,
                result.adapter
            );
        }
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

/// A small seeded generator for tests that need the same random inputs every run.
pub struct SplitMix(pub u64);

impl SplitMix {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Copies the files (not the subfolders) of `from` into `to`.
pub fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// A tensor to write: name, dtype, shape, little-endian bytes.
pub type RawTensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// A tensor held in memory, as safetensors writes it.
pub struct OwnedTensor(pub Dtype, pub Vec<usize>, pub Vec<u8>);

impl safetensors::View for &OwnedTensor {
    fn dtype(&self) -> Dtype {
        self.0
    }
    fn shape(&self) -> &[usize] {
        &self.1
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        (&self.2[..]).into()
    }
    fn data_len(&self) -> usize {
        self.2.len()
    }
}

/// Writes `tensors` as the safetensors file `path`.
pub fn write_safetensors(path: &std::path::Path, tensors: &[(String, OwnedTensor)]) {
    let refs: Vec<(String, &OwnedTensor)> = tensors.iter().map(|(n, t)| (n.clone(), t)).collect();
    safetensors::serialize_to_file(refs, None, path).unwrap();
}

/// Rewrites the safetensors file at `path` through `edit(name, dtype, shape, bytes)`, which
/// returns the tensors to write instead (none to drop one).
pub fn rewrite_safetensors(
    path: &std::path::Path,
    edit: impl Fn(&str, Dtype, &[usize], &[u8]) -> Vec<RawTensor>,
) {
    let bytes = std::fs::read(path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors = Vec::new();
    for (name, view) in file.tensors() {
        for (n, d, s, b) in edit(&name, view.dtype(), view.shape(), view.data()) {
            tensors.push((n, OwnedTensor(d, s, b)));
        }
    }
    drop(file);
    write_safetensors(path, &tensors);
}

/// The tensor unchanged, for [`rewrite_safetensors`].
pub fn keep(name: &str, d: Dtype, s: &[usize], b: &[u8]) -> Vec<RawTensor> {
    vec![(name.to_owned(), d, s.to_vec(), b.to_vec())]
}

/// Rewrites the JSON file at `path` through `edit`.
pub fn edit_json(path: &std::path::Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut value);
    std::fs::write(path, value.to_string()).unwrap();
}

/// A PNG whose header declares `width × height`, with one empty data chunk: enough for a
/// decoder to read the size, far too little to decode.
pub fn png_header(width: u32, height: u32) -> Vec<u8> {
    fn crc32(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &byte in bytes {
            crc ^= u32::from(byte);
            for _ in 0..8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut header = width.to_be_bytes().to_vec();
    header.extend(height.to_be_bytes());
    header.extend([8, 2, 0, 0, 0]); // 8-bit RGB
    for (kind, data) in [(b"IHDR", header), (b"IDAT", Vec::new())] {
        let mut chunk = kind.to_vec();
        chunk.extend(&data);
        png.extend((data.len() as u32).to_be_bytes());
        png.extend(&chunk);
        png.extend(crc32(&chunk).to_be_bytes());
    }
    png
}
