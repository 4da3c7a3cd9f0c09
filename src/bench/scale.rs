//! How time and memory grow with the batch (`mmlora bench --scale`): images per batch at the
//! base and with adapters mixed, then adapters loaded beyond the GPU slots.
//!
//! Each configuration gets a fresh engine, set up and warmed on its own, and its memory is read
//! over that set-up and warm-up call: the process's peak resident set (reset first through
//! `/proc/self/clear_refs` on Linux) and what the device's allocator then holds (GPU only). The
//! timed calls of an image count's base and mixed configurations then take turns, so their
//! ratio is not skewed by the machine's speed drifting between them.

use std::time::Instant;

use serde::Serialize;

use super::{
    Compute, Preset, RunSetup, engine_with_adapters, in_turns, median, mixed_batch, random_images,
    resized_side, steps,
};
use crate::engine::{Engine, EngineError, Request};
use crate::models::VisionTower;
use crate::ops::kernels::KernelPins;
use crate::runtime::device::{Precision, RuntimeDevice};

/// What to sweep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScaleSpec {
    /// The model shape.
    pub preset: Preset,
    /// Side of each (square) image in pixels (resized as the image processor resizes it).
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
    /// Kernels pinned by name.
    pub kernels: KernelPins,
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
            kernels: KernelPins::default(),
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
    /// What ran (`adapters`: distinct adapters in the batch, 0 for the base model).
    #[serde(flatten)]
    pub setup: RunSetup,
    /// Adapters registered with the engine (all in host memory).
    pub loaded: usize,
    /// GPU slots.
    pub slots: usize,
    /// Scheduler steps per call.
    pub steps: usize,
    /// Median time of one batch.
    pub median_ms: f64,
    /// `median_ms / images`.
    pub ms_per_image: f64,
    /// Images per second at the median.
    pub img_per_s: f64,
    /// Peak resident set of the process during the configuration, MiB (model weights, adapters
    /// in host memory and, on the CPU backend, every activation); `None` where it cannot be read.
    pub peak_rss_mib: Option<f64>,
    /// Resident set of the process when the configuration's set-up began, MiB: what earlier
    /// configurations (and the allocator) still held; `peak_rss_mib` less this is what this
    /// configuration added at most. `None` where it cannot be read.
    pub start_rss_mib: Option<f64>,
    /// Bytes the device's allocator holds at the end of the configuration, MiB (`None` on the
    /// CPU backend).
    pub device_reserved_mib: Option<f64>,
}

/// Runs the two sweeps of `spec` on `device`, telling `progress` what it is doing and `done` each
/// record as soon as its configuration is timed (a run stopped midway keeps those).
pub fn run(
    spec: &ScaleSpec,
    device: &RuntimeDevice,
    mut progress: impl FnMut(&str),
    mut done: impl FnMut(&ScaleRecord),
) -> Result<Vec<ScaleRecord>, EngineError> {
    let most_images = (spec.images.iter().copied().chain([spec.adapter_images]))
        .max()
        .unwrap_or(1);
    let spec = &ScaleSpec {
        side: resized_side(spec.side, most_images, spec.preset.layout())?,
        ..spec.clone()
    };
    let model = spec.preset.random(&device.device);
    let requests = random_images(most_images, spec.side, model.layout());
    let sweep = Sweep {
        spec,
        device,
        compute: (spec.precision, spec.kernels),
        model: &*model,
        requests: &requests,
    };

    let mut groups: Vec<Vec<Configuration>> = spec
        .images
        .iter()
        .map(|&images| {
            let mixed = spec.mixed.min(images);
            vec![
                Configuration::new("images", images, 0, 1),
                Configuration::new("images", images, mixed, mixed),
            ]
        })
        .collect();
    groups.extend(spec.adapters.iter().map(|&adapters| {
        vec![Configuration::new(
            "adapters",
            spec.adapter_images,
            adapters,
            spec.slots,
        )]
    }));
    let mut records = Vec::new();
    for group in &groups {
        for record in sweep.in_turns(group, &mut progress)? {
            done(&record);
            records.push(record);
        }
    }
    Ok(records)
}

/// What every configuration of one sweep shares.
struct Sweep<'a> {
    spec: &'a ScaleSpec,
    device: &'a RuntimeDevice,
    compute: Compute,
    model: &'a dyn VisionTower,
    requests: &'a [Request],
}

/// One point of a sweep.
struct Configuration {
    sweep: &'static str,
    images: usize,
    /// Adapters loaded, request `i` on adapter `i % adapters` (0: the base model).
    adapters: usize,
    slots: usize,
}

impl Configuration {
    fn new(sweep: &'static str, images: usize, adapters: usize, slots: usize) -> Self {
        Self {
            sweep,
            images,
            adapters,
            slots,
        }
    }
}

/// A configuration's engine after its warm-up call, with what that call used.
struct Warm {
    engine: Engine,
    batch: Vec<Request>,
    steps: usize,
    peak_rss_mib: Option<f64>,
    start_rss_mib: Option<f64>,
    device_reserved_mib: Option<f64>,
}

impl Sweep<'_> {
    /// Sets up and warms each of `configurations` in order, reading its memory, then times them
    /// in turns (one call of each per round), so a drift of the machine's speed shows in all of
    /// them alike and their ratios hold.
    ///
    /// The engines of earlier configurations stay alive while later ones warm up: put the one
    /// that holds least (the base model) first.
    fn in_turns(
        &self,
        configurations: &[Configuration],
        progress: &mut impl FnMut(&str),
    ) -> Result<Vec<ScaleRecord>, EngineError> {
        let mut warm = Vec::with_capacity(configurations.len());
        for configuration in configurations {
            warm.push(self.warm_up(configuration, progress)?);
        }
        let times = in_turns(warm.len(), self.spec.repeats, |i, _| {
            let started = Instant::now();
            let Warm { engine, batch, .. } = &mut warm[i];
            engine.encode(batch, false)?;
            Ok::<_, EngineError>(started.elapsed().as_secs_f64() * 1e3)
        })?;
        Ok(configurations
            .iter()
            .zip(warm)
            .zip(&times)
            .map(|((configuration, warm), times)| self.record(configuration, &warm, median(times)))
            .collect())
    }

    /// A fresh engine for `configuration` after one call, with the process's peak resident set
    /// over its set-up and that call, and what the device's allocator then holds.
    fn warm_up(
        &self,
        configuration: &Configuration,
        progress: &mut impl FnMut(&str),
    ) -> Result<Warm, EngineError> {
        let Configuration {
            images,
            adapters,
            slots,
            ..
        } = *configuration;
        progress(&format!(
            "{images} images, {} of {adapters} adapters over {slots} slots",
            adapters.min(images)
        ));
        self.device.device.memory_cleanup();
        let rss_reset = reset_peak_rss();
        let start_rss_mib = rss_bytes("VmRSS:").map(mib);
        let rank = self.rank(configuration);
        let mut engine =
            engine_with_adapters(self.model, self.device, self.compute, slots, adapters, rank)?;
        let batch = mixed_batch(&self.requests[..images], adapters, rank);
        let encoded = engine.encode(&batch, false)?;
        Ok(Warm {
            engine,
            batch,
            steps: steps(&encoded),
            peak_rss_mib: rss_reset.then(|| rss_bytes("VmHWM:")).flatten().map(mib),
            start_rss_mib,
            device_reserved_mib: self
                .device
                .wgpu
                .as_ref()
                .and_then(|_| self.device.device.memory_pool_usage())
                .map(|usage| mib(usage.bytes_reserved)),
        })
    }

    fn rank(&self, configuration: &Configuration) -> usize {
        if configuration.adapters == 0 {
            0
        } else {
            self.spec.rank
        }
    }

    fn record(&self, configuration: &Configuration, warm: &Warm, median_ms: f64) -> ScaleRecord {
        let images = configuration.images;
        ScaleRecord {
            kind: "scale",
            sweep: configuration.sweep,
            setup: RunSetup::new(
                self.device,
                self.spec.preset,
                self.compute,
                images,
                self.spec.side,
                configuration.adapters.min(images),
                self.rank(configuration),
            ),
            loaded: configuration.adapters,
            slots: configuration.slots,
            steps: warm.steps,
            median_ms,
            ms_per_image: median_ms / images as f64,
            img_per_s: images as f64 / (median_ms / 1e3),
            peak_rss_mib: warm.peak_rss_mib,
            start_rss_mib: warm.start_rss_mib,
            device_reserved_mib: warm.device_reserved_mib,
        }
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Resets the process's peak resident set to its current size (Linux); `false` where that is
/// not possible, so the peak read later would not belong to this configuration alone.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The process's resident set as `/proc/self/status` reports it under `field` (`VmRSS:` now,
/// `VmHWM:` its peak), in bytes, where the system tells it.
fn rss_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with(field))?;
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
            kernels: KernelPins::default(),
        };
        let records = run(&spec, &crate::runtime::device::cpu(), |_| (), |_| ()).unwrap();
        let seen: Vec<_> = records
            .iter()
            .map(|r| {
                let setup = &r.setup;
                (
                    r.sweep,
                    setup.images,
                    r.loaded,
                    setup.adapters,
                    r.slots,
                    r.steps,
                )
            })
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
                let start = record.start_rss_mib.expect("Linux reports VmRSS");
                // The peak was reset to the resident set just before `start` was read. The
                // kernel counts resident pages in per-CPU batches, so the two may disagree by a
                // few pages (seen: start 16 KiB above the peak): 1 MiB of slack.
                assert!(rss > 1.0 && start > 1.0 && start <= rss + 1.0, "{record:?}");
            }
        }
    }
}
