//! What the demo shows of a run: per-patch change of the tower output against the base model,
//! pooled-embedding similarities, timings.

use std::path::PathBuf;

use mmlora::engine::Encoded;
use mmlora::preprocess::patch_positions;

use crate::worker::BatchRow;

/// Per-patch values over an image's patch grid.
#[derive(Debug, Clone)]
pub struct Heat {
    /// Patch rows.
    pub rows: usize,
    /// Patch columns.
    pub columns: usize,
    /// Row-major values.
    pub values: Vec<f32>,
}

impl Heat {
    /// The largest value (0 for an all-zero map).
    pub fn max(&self) -> f32 {
        self.values.iter().copied().fold(0.0, f32::max)
    }
}

/// One row's result.
#[derive(Debug, Clone)]
pub struct RowResult {
    /// Its image.
    pub image: PathBuf,
    /// Its adapter.
    pub adapter: Option<String>,
    /// Tower tokens (patches).
    pub tower_tokens: usize,
    /// Connector tokens (embeddings for the language model).
    pub embeds: usize,
    /// ‖tower − base tower‖ per patch.
    pub heat: Heat,
    /// ‖tower − base‖ / ‖base‖ over the whole image.
    pub moved: f32,
    /// The step it ran in, and that step's time in ms.
    pub step: usize,
    /// The step's time.
    pub step_ms: f64,
}

/// A finished run.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// One per batch row.
    pub rows: Vec<RowResult>,
    /// Cosine similarity of the rows' mean-pooled embeddings.
    pub cosine: Vec<Vec<f32>>,
    /// Wall time of the engine call.
    pub seconds: f64,
    /// Requests in the call (rows plus one base per image).
    pub requests: usize,
    /// The device.
    pub device: String,
}

/// Builds the run's summary from the rows' results and their images' base results.
pub fn summarise<'a>(
    rows: &[BatchRow],
    encoded: &[Encoded],
    base_of: impl Fn(&PathBuf) -> &'a Encoded,
    merge: usize,
    (seconds, requests): (f64, usize),
    device: String,
) -> RunResult {
    let results: Vec<RowResult> = rows
        .iter()
        .zip(encoded)
        .map(|(row, result)| {
            let base = base_of(&row.image);
            let tower = result.tower.as_ref().expect("the demo asks for the tower");
            let base_tower = base.tower.as_ref().expect("the demo asks for the tower");
            let heat = patch_change(
                &tower.values,
                &base_tower.values,
                tower.shape[1],
                result.grid_thw,
                merge,
            );
            let moved = (squared_distance(&tower.values, &base_tower.values)
                / dot(&base_tower.values, &base_tower.values))
            .sqrt();
            RowResult {
                image: row.image.clone(),
                adapter: row.adapter.clone(),
                tower_tokens: tower.shape[0],
                embeds: result.embeds.shape[0],
                heat,
                moved: moved as f32,
                step: result.step,
                step_ms: result.step_time.as_secs_f64() * 1e3,
            }
        })
        .collect();
    let pooled: Vec<Vec<f32>> = encoded
        .iter()
        .map(|r| mean_rows(&r.embeds.values, r.embeds.shape[1]))
        .collect();
    let cosine = pooled
        .iter()
        .map(|a| pooled.iter().map(|b| cosine(a, b)).collect())
        .collect();
    RunResult {
        rows: results,
        cosine,
        seconds,
        requests,
        device,
    }
}

/// ‖a − b‖ per tower row, placed at the row's patch (first frame).
fn patch_change(a: &[f32], b: &[f32], width: usize, grid_thw: [usize; 3], merge: usize) -> Heat {
    let [_, rows, columns] = grid_thw;
    let mut values = vec![0.0; rows * columns];
    for (i, [frame, row, column]) in patch_positions(grid_thw, merge).into_iter().enumerate() {
        if frame == 0 {
            let span = i * width..(i + 1) * width;
            values[row * columns + column] =
                squared_distance(&a[span.clone()], &b[span]).sqrt() as f32;
        }
    }
    Heat {
        rows,
        columns,
        values,
    }
}

fn squared_distance(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum()
}

fn mean_rows(values: &[f32], width: usize) -> Vec<f32> {
    let rows = values.len() / width;
    (0..width)
        .map(|c| (0..rows).map(|r| values[r * width + c]).sum::<f32>() / rows as f32)
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    (dot(a, b) / (dot(a, a) * dot(b, b)).sqrt()) as f32
}
