//! What a front end shows of a batch run (the desktop demo, the web page): how far each patch
//! moved from the base model, pooled-embedding similarities, timings.
//!
//! A run encodes the batch's rows and, in the same engine call, each of their images once
//! without adapter: the base each row's tower output is compared with.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::engine::{Encoded, ImageSource, Request};
use crate::preprocess::patch_positions;

/// One row of a batch: an image file and an adapter or none (as JSON, `{"image": path,
/// "adapter": name or null}`: the web page sends its batch so).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct BatchRow {
    /// The image file.
    pub image: PathBuf,
    /// The adapter's name, or none.
    pub adapter: Option<String>,
}

/// Per-patch values over an image's patch grid.
#[derive(Debug, Clone, Serialize)]
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
#[derive(Debug, Clone, Serialize)]
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
    /// The step it ran in.
    pub step: usize,
    /// That step's time in ms.
    pub step_ms: f64,
}

/// A finished run.
#[derive(Debug, Clone, Serialize)]
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

/// The engine call a run makes: the rows (ids `row0`, `row1`, …), then each distinct image
/// once without adapter (`base0`, …), all asking for the tower's output.
pub fn requests(rows: &[BatchRow]) -> Vec<Request> {
    let rows_requests = rows.iter().enumerate().map(|(i, row)| Request {
        id: format!("row{i}"),
        image: ImageSource::File(row.image.clone()),
        adapter: row.adapter.clone(),
    });
    let bases = distinct_images(rows)
        .into_iter()
        .enumerate()
        .map(|(i, image)| Request {
            id: format!("base{i}"),
            image: ImageSource::File(image.clone()),
            adapter: None,
        });
    rows_requests.chain(bases).collect()
}

/// The run's summary from the results of [`requests`]`(rows)`, in their order, with the
/// tower's output (`merge` is the model's spatial merge size).
pub fn summarise(
    rows: &[BatchRow],
    encoded: &[Encoded],
    merge: usize,
    seconds: f64,
    device: String,
) -> RunResult {
    let images = distinct_images(rows);
    let (rows_out, bases) = encoded.split_at(rows.len());
    let results: Vec<RowResult> = rows
        .iter()
        .zip(rows_out)
        .map(|(row, result)| {
            let base = &bases[images
                .iter()
                .position(|&image| *image == row.image)
                .expect("every image has a base")];
            let tower = result.tower.as_ref().expect("a run asks for the tower");
            let base_tower = base.tower.as_ref().expect("a run asks for the tower");
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
    let pooled: Vec<Vec<f32>> = rows_out
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
        requests: encoded.len(),
        device,
    }
}

/// The rows' images, each once, sorted.
fn distinct_images(rows: &[BatchRow]) -> Vec<&PathBuf> {
    let mut images: Vec<&PathBuf> = rows.iter().map(|r| &r.image).collect();
    images.sort();
    images.dedup();
    images
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

/// The colour the front ends draw a heatmap value `t` in (0 to 1, clamped): dark purple
/// through red and orange to pale yellow (matplotlib's inferno), as `[r, g, b]`.
pub fn colormap(t: f32) -> [u8; 3] {
    const STOPS: [(f32, [f32; 3]); 5] = [
        (0.0, [20.0, 11.0, 52.0]),
        (0.25, [101.0, 21.0, 110.0]),
        (0.5, [188.0, 55.0, 84.0]),
        (0.75, [249.0, 142.0, 9.0]),
        (1.0, [252.0, 255.0, 164.0]),
    ];
    let t = if t.is_nan() { 0.0 } else { t.clamp(0.0, 1.0) };
    let i = STOPS
        .iter()
        .rposition(|(s, _)| *s <= t)
        .unwrap_or(0)
        .min(STOPS.len() - 2);
    let ((t0, a), (t1, b)) = (STOPS[i], STOPS[i + 1]);
    let f = (t - t0) / (t1 - t0);
    let mix = |k: usize| (a[k] + (b[k] - a[k]) * f) as u8;
    [mix(0), mix(1), mix(2)]
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::engine::HostTensor;

    fn row(image: &str, adapter: Option<&str>) -> BatchRow {
        BatchRow {
            image: PathBuf::from(image),
            adapter: adapter.map(str::to_owned),
        }
    }

    /// A result over grid `[1, 2, 4]` (merge 2: 8 tower rows of width 3, 2 embeddings of
    /// width 2) whose tower row `i` holds `tower(i)` and whose embeddings are `embeds`.
    fn encoded(tower: impl Fn(usize) -> f32, embeds: [f32; 4]) -> Encoded {
        Encoded {
            id: String::new(),
            adapter: None,
            grid_thw: [1, 2, 4],
            embeds: HostTensor {
                shape: [2, 2],
                values: embeds.to_vec(),
            },
            tower: Some(HostTensor {
                shape: [8, 3],
                values: (0..8).flat_map(|i| [tower(i); 3]).collect(),
            }),
            deepstack: None,
            step: 0,
            step_time: Duration::from_millis(2),
        }
    }

    #[test]
    fn a_run_asks_for_the_rows_then_each_image_once_without_adapter() {
        let rows = [
            row("b.png", Some("x")),
            row("a.png", None),
            row("b.png", None),
        ];
        let asked: Vec<(String, String, Option<String>)> = requests(&rows)
            .into_iter()
            .map(|r| match r.image {
                ImageSource::File(path) => (r.id, path.display().to_string(), r.adapter),
                other => panic!("{other:?}"),
            })
            .collect();
        let want = [
            ("row0", "b.png", Some("x")),
            ("row1", "a.png", None),
            ("row2", "b.png", None),
            ("base0", "a.png", None),
            ("base1", "b.png", None),
        ];
        let want: Vec<_> = want
            .iter()
            .map(|(id, image, adapter)| {
                (
                    id.to_string(),
                    image.to_string(),
                    adapter.map(str::to_owned),
                )
            })
            .collect();
        assert_eq!(asked, want);
    }

    #[test]
    fn heat_is_each_patchs_distance_from_its_base_at_its_place_in_the_grid() {
        let rows = [row("a.png", Some("x")), row("a.png", None)];
        let moved = encoded(|i| 1.0 + i as f32, [1.0, 0.0, 1.0, 0.0]);
        let base = encoded(|_| 1.0, [0.0, 1.0, 0.0, 1.0]);
        let run = summarise(&rows, &[moved, base.clone(), base], 2, 0.5, "cpu".into());

        // Tower row i moved by i in each of its 3 columns: ‖·‖ = i√3, at the patch the merge
        // order puts row i.
        let heat = &run.rows[0].heat;
        assert_eq!((heat.rows, heat.columns), (2, 4));
        for (i, [_, r, c]) in patch_positions([1, 2, 4], 2).into_iter().enumerate() {
            let want = i as f32 * 3f32.sqrt();
            assert!((heat.values[r * 4 + c] - want).abs() <= 1e-6 * want.max(1.0));
        }
        // ‖tower − base‖ / ‖base‖ = √(3 Σ i²) / √24 over i = 0..8 (f64 sums of small integers).
        let want = ((3.0 * 140.0) / 24.0f64).sqrt() as f32;
        assert!((run.rows[0].moved - want).abs() <= 1e-6 * want);
        assert_eq!(run.rows[1].heat.max(), 0.0);
        assert_eq!(run.rows[1].moved, 0.0);
        // Mean-pooled embeddings [1, 0] and [0, 1]: orthogonal, each 1 with itself.
        assert_eq!(run.cosine, vec![vec![1.0, 0.0], vec![0.0, 1.0]]);
        assert_eq!((run.requests, run.rows[0].step_ms), (3, 2.0));
    }

    #[test]
    fn the_colour_scale_runs_from_its_first_stop_to_its_last() {
        assert_eq!(colormap(0.0), [20, 11, 52]);
        assert_eq!(colormap(-3.0), [20, 11, 52]);
        assert_eq!(colormap(f32::NAN), [20, 11, 52]);
        assert_eq!(colormap(1.0), [252, 255, 164]);
        assert_eq!(colormap(7.0), [252, 255, 164]);
        assert_eq!(colormap(0.5), [188, 55, 84]);
    }
}
