//! Shows the library's progress events ([`mmlora::runtime::progress`]) as bars on stderr, on a
//! terminal only: one bar per task, gone when the task is done.

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Mutex, PoisonError};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

/// A `tracing` layer that draws a bar for each task that reports progress.
pub struct Bars {
    /// Where the bars draw: stderr (hidden where it is not a terminal), or nowhere in tests.
    target: fn() -> ProgressDrawTarget,
    bars: Mutex<HashMap<String, ProgressBar>>,
}

impl Bars {
    /// Bars on stderr.
    pub fn stderr() -> Self {
        Self {
            target: ProgressDrawTarget::stderr,
            bars: Mutex::default(),
        }
    }

    /// The bar of `task` and its position, where one is shown.
    #[cfg(test)]
    fn shown(&self, task: &str) -> Option<(u64, Option<u64>)> {
        let bars = self.bars.lock().unwrap_or_else(PoisonError::into_inner);
        bars.get(task).map(|bar| (bar.position(), bar.length()))
    }
}

/// The fields of one progress event.
#[derive(Default)]
struct Progress {
    task: String,
    done: u64,
    total: u64,
}

impl Visit for Progress {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "task" {
            self.task = value.to_owned();
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "done" => self.done = value,
            "total" => self.total = value,
            _ => {}
        }
    }

    fn record_debug(&mut self, _field: &Field, _value: &dyn Debug) {}
}

impl<S: Subscriber> Layer<S> for Bars {
    fn on_event(&self, event: &Event<'_>, _context: Context<'_, S>) {
        if event.metadata().target() != mmlora::runtime::progress::TARGET {
            return;
        }
        let mut progress = Progress::default();
        event.record(&mut progress);
        let mut bars = self.bars.lock().unwrap_or_else(PoisonError::into_inner);
        if progress.done >= progress.total {
            if let Some(bar) = bars.remove(&progress.task) {
                bar.finish_and_clear();
            }
            return;
        }
        let bar = bars.entry(progress.task.clone()).or_insert_with(|| {
            let bar = ProgressBar::with_draw_target(Some(progress.total), (self.target)());
            if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len}") {
                bar.set_style(style);
            }
            bar.set_message(progress.task.clone());
            bar
        });
        bar.set_length(progress.total);
        bar.set_position(progress.done);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tracing_subscriber::prelude::*;

    use super::*;
    use mmlora::runtime::progress;

    /// Forwards to shared bars, so the test can look at them after the subscriber has them.
    struct Shared(Arc<Bars>);

    impl<S: Subscriber> Layer<S> for Shared {
        fn on_event(&self, event: &Event<'_>, context: Context<'_, S>) {
            self.0.on_event(event, context);
        }
    }

    #[test]
    fn a_bar_follows_its_task_and_goes_when_done() {
        let bars = Arc::new(Bars {
            target: ProgressDrawTarget::hidden,
            bars: Mutex::default(),
        });
        let subscriber = tracing_subscriber::registry().with(Shared(Arc::clone(&bars)));
        tracing::subscriber::with_default(subscriber, || {
            progress::report("loading tensors", 1, 3);
            assert_eq!(bars.shown("loading tensors"), Some((1, Some(3))));
            progress::report("encoding steps", 1, 2);
            progress::report("loading tensors", 2, 3);
            assert_eq!(bars.shown("loading tensors"), Some((2, Some(3))));
            assert_eq!(bars.shown("encoding steps"), Some((1, Some(2))));
            progress::report("loading tensors", 3, 3);
            assert_eq!(bars.shown("loading tensors"), None);
            tracing::info!(target: "mmlora::other", task = "x", done = 1u64, total = 2u64);
            assert_eq!(bars.shown("x"), None, "other targets are not progress");
        });
    }
}
