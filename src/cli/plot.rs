//! `mmlora bench --plot`: throughput against the number of mixed adapters, one line per rank,
//! the base model as a dashed level, drawn with plotters into a PNG.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use mmlora::bench::BenchRecord;

/// Width and height of the picture in pixels.
const SIZE: (u32, u32) = (960, 600);

/// Why a plot could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// There is nothing to draw.
    #[error("no benchmark records to plot")]
    Empty,
    /// Drawing failed.
    #[error("drawing the plot: {0}")]
    Draw(String),
    /// The file could not be written.
    #[error("cannot write {path}: {reason}")]
    Write {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        reason: String,
    },
}

/// Draws `records` (one `mmlora bench` run) as throughput against mixed adapters into the PNG
/// file `path`.
pub fn throughput_png(records: &[BenchRecord], path: &Path) -> Result<(), PlotError> {
    let base = records
        .iter()
        .find(|r| r.setup.adapters == 0)
        .ok_or(PlotError::Empty)?;
    let mut ranks: Vec<usize> = records
        .iter()
        .filter(|r| r.setup.adapters > 0)
        .map(|r| r.setup.rank)
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    // The adapter counts measured, the only ones labelled on the x axis.
    let mut counts: Vec<usize> = records
        .iter()
        .filter(|r| r.setup.adapters > 0)
        .map(|r| r.setup.adapters)
        .collect();
    counts.sort_unstable();
    counts.dedup();
    let max_adapters = counts.last().copied().unwrap_or(1);
    let top = records.iter().map(|r| r.img_per_s).fold(0.0, f64::max) * 1.15;

    // A font compiled in, so the picture is the same on every machine.
    register_font(
        "sans-serif",
        FontStyle::Normal,
        epaint_default_fonts::UBUNTU_LIGHT,
    )
    .map_err(|_| PlotError::Draw("the embedded font could not be read".to_owned()))?;
    let mut pixels = vec![255u8; (SIZE.0 * SIZE.1 * 3) as usize];
    {
        let draw = |e: &dyn std::fmt::Display| PlotError::Draw(e.to_string());
        let root = BitMapBackend::with_buffer(&mut pixels, SIZE).into_drawing_area();
        let title = format!(
            "{}: {} images of {}², {}",
            base.setup.preset, base.setup.images, base.setup.side, base.setup.adapter_name
        );
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(16)
            .x_label_area_size(48)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..max_adapters as f64 + 0.5, 0.0..top)
            .map_err(|e| draw(&e))?;
        let y_decimals = if top < 10.0 {
            3
        } else if top < 1000.0 {
            1
        } else {
            0
        };
        chart
            .configure_mesh()
            .x_labels(max_adapters + 1)
            .disable_x_mesh()
            .x_label_formatter(&|x| {
                let measured = counts.iter().any(|&k| (k as f64 - x).abs() < 1e-9);
                if measured {
                    format!("{x:.0}")
                } else {
                    String::new()
                }
            })
            .y_label_formatter(&|y| format!("{y:.y_decimals$}"))
            .x_desc("distinct adapters mixed in the batch")
            .y_desc("images per second")
            .label_style(("sans-serif", 15))
            .draw()
            .map_err(|e| draw(&e))?;
        chart
            .draw_series(DashedLineSeries::new(
                [
                    (0.0, base.img_per_s),
                    (max_adapters as f64 + 0.5, base.img_per_s),
                ],
                8,
                6,
                BLACK.stroke_width(2),
            ))
            .map_err(|e| draw(&e))?
            .label(format!("base model: {:.3} img/s", base.img_per_s))
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.stroke_width(2)));
        for (i, &rank) in ranks.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let mut points: Vec<(f64, f64)> = records
                .iter()
                .filter(|r| r.setup.adapters > 0 && r.setup.rank == rank)
                .map(|r| (r.setup.adapters as f64, r.img_per_s))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(3)))
                .map_err(|e| draw(&e))?
                .label(format!("rank {rank}"))
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], color.stroke_width(3))
                });
            chart
                .draw_series(
                    points
                        .into_iter()
                        .map(|p| Circle::new(p, 5, color.filled())),
                )
                .map_err(|e| draw(&e))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font(("sans-serif", 15))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| draw(&e))?;
        root.present().map_err(|e| draw(&e))?;
    }
    let image = image::RgbImage::from_raw(SIZE.0, SIZE.1, pixels)
        .expect("the buffer has the picture's size");
    mmlora::files::write_whole(path, |file| {
        image
            .write_to(file, image::ImageFormat::Png)
            .map_err(std::io::Error::other)
    })
    .map_err(|e| PlotError::Write {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    Ok(())
}
