//! Progress of long library work (reading a checkpoint's tensors, encoding a batch in several
//! steps), reported as `tracing` events for a front end to show: the library draws nothing
//! itself, and a program without a subscriber pays next to nothing for them.

/// The target of progress events.
pub const TARGET: &str = "mmlora::progress";

/// Reports that `done` of `total` units of `task` are done.
pub fn report(task: &'static str, done: u64, total: u64) {
    tracing::info!(target: TARGET, task, done, total);
}
