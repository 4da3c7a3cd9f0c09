//! How time and memory grow with the batch (`mmlora bench --scale`): images per batch at the
//! base and with adapters mixed, then adapters loaded beyond the GPU slots.
//!
//! Configurations run one after another (not in turns), each on a fresh engine, so the peak
//! memory read after one belongs to it: the process's peak resident set (reset before each
//! configuration through `/proc/self/clear_refs` on Linux) and what the device's allocator holds
//! when it ends (GPU only; its pools only grow during a configuration).

use std::time::Instant;

use serde::Serialize;

use super::{Preset, engine_with_adapters, median, mixed_batch, random_images};
use crate::device::{Precision, RuntimeDevice};
use crate::engine::EngineError;
use crate::model::qwen2_vl::Qwen2VlVision;
use crate::preprocess::PreprocessConfig;

/// What to sweep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScaleSpec {
    /// The model shape.
    pub preset: Preset,
    /// Side of each (square) image in pixels.
    pub side: usize,
    /// Adapter rank.
    pub rank: usize,
    /// Timed calls per configuration, after one warm-up call.
    pub repeats: usize,
    /// Images per batch in the image sweep.
    pub images: Vec<usize>,
    /// Distinct adapters mixed over the images in the image sweep (fewer when the batch has
    /// fewer images).
    pub mixed: usize,
    /// Adapters loaded in the adapter sweep, mixed over its batch (request `i` on adapter
    /// `i % loaded`).
    pub adapters: Vec<usize>,
    /// GPU slots in the adapter sweep: a batch with more distinct adapters runs in several steps
    /// and swaps adapters in and out of the slots on every call.
    pub slots: usize,
    /// Images per batch in the adapter sweep.
    pub adapter_images: usize,
    /// The float type the model computes in.
    pub precision: Precision,
}

/// Image side of the sweep by default: 64 images of it are 4096 tower rows.
pub const SCALE_SIDE: usize = 112;

impl Default for ScaleSpec {
    /// 1→64 images (base and 8 adapters mixed), then 1→64 adapters over 16 slots and 64
    /// images, rank 16, images of 112².
    fn default() -> Self {
        let doubling = vec![1, 2, 4, 8, 16, 32, 64];
        Self {
            preset: Preset::Qwen2Vl2b,
            side: SCALE_SIDE,
            rank: 16,
            repeats: 2,
            images: doubling.clone(),
            mixed: 8,
            adapters: doubling,
            slots: 16,
            adapter_images: 64,
            precision: Precision::F32,
        }
    }
}

/// One configuration's result (a line of `mmlora bench --scale --json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScaleRecord {
    /// `scale`: tells these lines from the throughput lines.
    pub kind: &'static str,
    /// `images` or `adapters`: which sweep.
    pub sweep: &'static str,
    /// `cpu` or `gpu`.
    pub device: String,
    /// What the device is.
    pub adapter_name: String,
    /// The model shape.
    pub preset: String,
    /// Image side in pixels.
    pub side: usize,
    /// Images per batch.
    pub images: usize,
    /// Adapters registered with the engine (all in host memory).
    pub loaded: usize,
    /// Distinct adapters in the batch (0: the base model).
    pub adapters: usize,
    /// Adapter rank (0: the base model).
    pub rank: usize,
    /// GPU slots.
    pub slots: usize,
    /// Scheduler steps per call.
    pub steps: usize,
    /// `f32` or `f16`.
    pub precision: String,
    /// Median time of one batch.
    pub median_ms: f64,
    /// `median_ms / images`.
    pub ms_per_image: f64,
    /// Images per second at the median.
    pub img_per_s: f64,
    /// Peak resident set of the process during the configuration, MiB (model weights, adapters
    /// in host memory and, on the CPU backend, every activation); `None` where it cannot be read.
    pub peak_rss_mib: Option<f64>,
    /// Bytes the device's allocator holds at the end of the configuration, MiB (`None` on the
    /// CPU backend).
    pub device_reserved_mib: Option<f64>,
}

/// Runs the two sweeps of `spec` on `device`, telling `progress` what it is doing.
pub fn run(
    spec: &ScaleSpec,
    device: &RuntimeDevice,
    device_kind: &str,
    mut progress: impl FnMut(&str),
) -> Result<Vec<ScaleRecord>, EngineError> {
    let config = spec.preset.config();
    let model = Qwen2VlVision::random(config.clone(), &device.device);
    let most_images = spec.images.iter().copied().chain([spec.adapter_images]);
    let requests = random_images(
        most_images.max().unwrap_or(1),
        spec.side,
        &config,
        &PreprocessConfig::default(),
    )?;

    let mut configurations = Vec::new();
    for &images in &spec.images {
        configurations.push(("images", images, 0, 1));
        let mixed = spec.mixed.min(images);
        configurations.push(("images", images, mixed, mixed));
    }
    for &adapters in &spec.adapters {
        configurations.push(("adapters", spec.adapter_images, adapters, spec.slots));
    }

    let mut records = Vec::with_capacity(configurations.len());
    for (sweep, images, adapters, slots) in configurations {
        let distinct = adapters.min(images);
        progress(&format!(
            "{images} images, {distinct} of {adapters} adapters over {slots} slots"
        ));
        device.device.memory_cleanup();
        let rss_reset = reset_peak_rss();
        let rank = if adapters == 0 { 0 } else { spec.rank };
        let mut engine =
            engine_with_adapters(&model, device, spec.precision, slots, adapters, rank)?;
        let batch = mixed_batch(&requests[..images], adapters, rank);
        let encoded = engine.encode(&batch, false)?; // warm-up
        let steps = encoded.iter().map(|e| e.step + 1).max().unwrap_or(0);
        let mut times = Vec::with_capacity(spec.repeats);
        for _ in 0..spec.repeats.max(1) {
            let started = Instant::now();
            engine.encode(&batch, false)?;
            times.push(started.elapsed().as_secs_f64() * 1e3);
        }
        let median_ms = median(&mut times);
        records.push(ScaleRecord {
            kind: "scale",
            sweep,
            device: device_kind.to_owned(),
            adapter_name: device.description.clone(),
            preset: spec.preset.name().to_owned(),
            side: spec.side,
            images,
            loaded: adapters,
            adapters: distinct,
            rank,
            slots,
            steps,
            precision: spec.precision.name().to_owned(),
            median_ms,
            ms_per_image: median_ms / images as f64,
            img_per_s: images as f64 / (median_ms / 1e3),
            peak_rss_mib: rss_reset.then(peak_rss_bytes).flatten().map(mib),
            device_reserved_mib: device
                .wgpu
                .as_ref()
                .and_then(|_| device.device.memory_pool_usage())
                .map(|usage| mib(usage.bytes_reserved)),
        });
    }
    Ok(records)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Resets the process's peak resident set to its current size (Linux); `false` where that is
/// not possible, so the peak read later would not belong to this configuration alone.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The process's peak resident set (`VmHWM`), in bytes, where the system tells it.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tiny_preset_sweeps_images_and_adapters_past_the_slots() {
        let spec = ScaleSpec {
            preset: Preset::Tiny,
            side: 56,
            rank: 4,
            repeats: 1,
            images: vec![1, 3],
            mixed: 2,
            adapters: vec![2, 5, 6],
            slots: 2,
            adapter_images: 5,
            precision: Precision::F32,
        };
        let records = run(&spec, &crate::device::cpu(), "cpu", |_| ()).unwrap();
        let seen: Vec<_> = records
            .iter()
            .map(|r| (r.sweep, r.images, r.loaded, r.adapters, r.slots, r.steps))
            .collect();
        assert_eq!(
            seen,
            [
                ("images", 1, 0, 0, 1, 1),
                ("images", 1, 1, 1, 1, 1),
                ("images", 3, 0, 0, 1, 1),
                ("images", 3, 2, 2, 2, 1),
                ("adapters", 5, 2, 2, 2, 1),
                // Five adapters over two slots: three steps.
                ("adapters", 5, 5, 5, 2, 3),
                // Six loaded, five images: five in the batch.
                ("adapters", 5, 6, 5, 2, 3),
            ]
        );
        for record in &records {
            assert!(record.median_ms > 0.0, "{record:?}");
            assert_eq!(
                record.device_reserved_mib, None,
                "no device pools on the CPU"
            );
            if cfg!(target_os = "linux") {
                let rss = record.peak_rss_mib.expect("Linux reports VmHWM");
                assert!(rss > 1.0, "{record:?}");
            }
        }
    }
}
