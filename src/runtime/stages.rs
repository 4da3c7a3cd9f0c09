//! A clock for the stages of a forward pass (`mmlora bench --stages`): where the time goes.
//!
//! A model with a [`StageClock`] attached marks the end of each stage. While the clock runs
//! ([`StageClock::start`] to [`StageClock::finish`]), each mark waits for the device and adds
//! the time since the last mark to its stage; while it does not, a mark does nothing. The
//! waits serialise what the device would overlap and break Burn's fusion across stages, so a
//! clocked pass is slower than a plain one: the bench reports both, side by side.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use burn::tensor::Device;
use serde::Serialize;

/// One kind of work in the tower's and the connector's forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// The patch embedding (the Conv3d as a matmul).
    PatchEmbed,
    /// Every layer norm (two per block, the merger's `ln_q`).
    Norm,
    /// `attn.qkv`'s base product.
    Qkv,
    /// Splitting q, k and v and rotating q and k.
    Rotary,
    /// Scores, softmax and the weighted sum of every image's attention.
    Attention,
    /// `attn.proj`'s base product.
    Proj,
    /// `mlp.fc1`'s base product.
    Fc1,
    /// QuickGELU in the blocks, GELU in the merger.
    Activation,
    /// `mlp.fc2`'s base product.
    Fc2,
    /// The residual additions.
    Residual,
    /// The merger's `mlp.0` base product.
    MergerMlp0,
    /// The merger's `mlp.2` base product.
    MergerMlp2,
    /// The LoRA op (shrink and expand) of every linear with adapters installed.
    LoraOp,
    /// The outputs cast to f32.
    Output,
}

impl Stage {
    /// The stage's name in the bench's table and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::PatchEmbed => "patch_embed",
            Self::Norm => "norm",
            Self::Qkv => "qkv",
            Self::Rotary => "rotary",
            Self::Attention => "attention",
            Self::Proj => "proj",
            Self::Fc1 => "fc1",
            Self::Activation => "activation",
            Self::Fc2 => "fc2",
            Self::Residual => "residual",
            Self::MergerMlp0 => "merger_mlp0",
            Self::MergerMlp2 => "merger_mlp2",
            Self::LoraOp => "lora_op",
            Self::Output => "output",
        }
    }
}

/// Time spent in one stage while the clock ran.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageTime {
    /// Summed over the stage's marks.
    pub total: Duration,
    /// How many marks it had.
    pub marks: usize,
}

/// What a running clock has seen.
#[derive(Debug)]
struct Timeline {
    device: Device,
    /// Where the last mark was, while the clock runs.
    last: Option<Instant>,
    times: BTreeMap<Stage, StageTime>,
}

/// A clock a model marks its stages on; detached (the default) it costs nothing. Clones share
/// one clock.
#[derive(Debug, Clone, Default)]
pub struct StageClock(Option<Arc<Mutex<Timeline>>>);

impl StageClock {
    /// A clock that waits for `device` at each mark while it runs.
    pub fn new(device: &Device) -> Self {
        Self(Some(Arc::new(Mutex::new(Timeline {
            device: device.clone(),
            last: None,
            times: BTreeMap::new(),
        }))))
    }

    /// Starts the clock, with no time on any stage: the next [`Self::begin`] starts the first
    /// stage.
    pub fn start(&self) {
        self.with_running(true, |timeline| timeline.times.clear());
    }

    /// Stops the clock and returns each stage's time since [`Self::start`] (empty for a
    /// detached clock).
    pub fn finish(&self) -> BTreeMap<Stage, StageTime> {
        let mut times = BTreeMap::new();
        self.with_running(false, |timeline| {
            times = std::mem::take(&mut timeline.times);
        });
        times
    }

    /// Where a forward pass begins: waits for the work queued before it (the uploads) and
    /// starts timing from there.
    pub fn begin(&self) {
        self.with_timeline(|timeline| {
            if timeline.last.is_some() {
                timeline.last = Some(wait(&timeline.device));
            }
        });
    }

    /// Where `stage` ends: waits for the device and adds the time since the last mark to
    /// `stage`.
    pub fn mark(&self, stage: Stage) {
        self.with_timeline(|timeline| {
            if let Some(last) = timeline.last {
                let now = wait(&timeline.device);
                let time = timeline.times.entry(stage).or_default();
                time.total += now - last;
                time.marks += 1;
                timeline.last = Some(now);
            }
        });
    }

    /// Runs `f` on the timeline of an attached clock.
    fn with_timeline(&self, f: impl FnOnce(&mut Timeline)) {
        if let Some(timeline) = &self.0 {
            f(&mut timeline.lock().unwrap_or_else(PoisonError::into_inner));
        }
    }

    /// Runs `f`, then sets the clock running (from now) or stopped.
    fn with_running(&self, running: bool, f: impl FnOnce(&mut Timeline)) {
        self.with_timeline(|timeline| {
            f(timeline);
            timeline.last = running.then(Instant::now);
        });
    }
}

/// Waits for what `device` has queued and returns when it finished. A failed wait is left to
/// the read that follows the pass, which reports it.
fn wait(device: &Device) -> Instant {
    let _ = device.sync();
    Instant::now()
}

#[cfg(test)]
mod tests {
    use burn::tensor::Tensor;

    use super::*;

    #[test]
    fn a_running_clock_adds_each_stage_its_marks() {
        let device = crate::runtime::device::cpu().device;
        let clock = StageClock::new(&device);
        clock.mark(Stage::Norm);
        assert!(clock.finish().is_empty(), "a stopped clock keeps nothing");

        clock.start();
        clock.begin();
        let x = Tensor::<2>::ones([64, 64], &device);
        let y = x.clone().matmul(x);
        clock.mark(Stage::Qkv);
        std::thread::sleep(Duration::from_millis(20));
        clock.mark(Stage::Norm);
        clock.mark(Stage::Qkv);
        drop(y);
        let times = clock.finish();
        assert_eq!(
            times.keys().copied().collect::<Vec<_>>(),
            [Stage::Norm, Stage::Qkv]
        );
        assert_eq!(
            (times[&Stage::Qkv].marks, times[&Stage::Norm].marks),
            (2, 1)
        );
        assert!(times[&Stage::Norm].total >= Duration::from_millis(20));

        clock.mark(Stage::Norm);
        assert!(clock.finish().is_empty(), "finish stopped it");
    }

    #[test]
    fn a_detached_clock_keeps_nothing() {
        let clock = StageClock::default();
        clock.start();
        clock.begin();
        clock.mark(Stage::Attention);
        assert!(clock.finish().is_empty());
    }
}
