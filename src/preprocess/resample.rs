//! Pillow's 8-bit resize, bit for bit: fixed-point coefficients per output position, a
//! horizontal pass, then a vertical pass.

use image::RgbImage;

use super::Resample;

/// Pillow's fixed-point precision for 8-bit resampling.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// For each output position: the first input index and the fixed-point weights of the inputs
/// it reads (Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc`).
fn coefficients(in_size: usize, out_size: usize, filter: Resample) -> Vec<(usize, Vec<i32>)> {
    let scale = in_size as f64 / out_size as f64;
    let filter_scale = scale.max(1.0);
    let support = filter.support() * filter_scale;
    let inverse_scale = 1.0 / filter_scale; // multiplied, not divided, as Pillow does
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let weights: Vec<f64> = (xmin..xmax)
                .map(|x| filter.weight((x as f64 - center + 0.5) * inverse_scale))
                .collect();
            let total: f64 = weights.iter().sum();
            let fixed = weights
                .iter()
                .map(|&w| {
                    let w = if total != 0.0 { w / total } else { w };
                    let scaled = w * f64::from(1u32 << PRECISION_BITS);
                    (if w < 0.0 { scaled - 0.5 } else { scaled + 0.5 }) as i32
                })
                .collect();
            (xmin, fixed)
        })
        .collect()
}

/// Pillow's `clip8`: drop the fixed-point fraction and clamp to a byte.
fn clip8(value: i32) -> u8 {
    (value >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Pillow's resize of an 8-bit RGB image with `filter`: a horizontal pass over the rows the
/// vertical pass reads, then the vertical pass, each rounding to bytes.
pub(super) fn resize(image: &RgbImage, width: usize, height: usize, filter: Resample) -> RgbImage {
    let (in_w, in_h) = (image.width() as usize, image.height() as usize);
    let horizontal = coefficients(in_w, width, filter);
    let vertical = coefficients(in_h, height, filter);
    let first_row = vertical[0].0;
    let last_row = vertical
        .last()
        .map(|(start, w)| start + w.len())
        .unwrap_or(first_row);
    let half = 1i32 << (PRECISION_BITS - 1);

    // Horizontal pass (skipped, as in Pillow, when the width does not change).
    let rows = last_row - first_row;
    let mut temp = vec![0u8; rows * width * 3];
    let temp_width = if width != in_w {
        for y in 0..rows {
            for (x, (start, weights)) in horizontal.iter().enumerate() {
                for c in 0..3 {
                    let mut sum = half;
                    for (i, &k) in weights.iter().enumerate() {
                        let px = image.get_pixel((start + i) as u32, (first_row + y) as u32);
                        sum += i32::from(px[c]) * k;
                    }
                    temp[(y * width + x) * 3 + c] = clip8(sum);
                }
            }
        }
        width
    } else {
        for y in 0..rows {
            for x in 0..in_w {
                let px = image.get_pixel(x as u32, (first_row + y) as u32);
                temp[(y * in_w + x) * 3..(y * in_w + x) * 3 + 3].copy_from_slice(&px.0);
            }
        }
        in_w
    };

    if height == in_h {
        return RgbImage::from_raw(temp_width as u32, rows as u32, temp)
            .expect("the buffer matches the size");
    }
    let mut out = RgbImage::new(temp_width as u32, height as u32);
    for (y, (start, weights)) in vertical.iter().enumerate() {
        for x in 0..temp_width {
            for c in 0..3 {
                let mut sum = half;
                for (i, &k) in weights.iter().enumerate() {
                    let row = start - first_row + i;
                    sum += i32::from(temp[(row * temp_width + x) * 3 + c]) * k;
                }
                out.get_pixel_mut(x as u32, y as u32)[c] = clip8(sum);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for filter in (1..=5).filter_map(Resample::from_pil) {
            for (inp, out) in [(100, 56), (56, 100), (37, 28), (28, 28)] {
                for (_, weights) in coefficients(inp, out, filter) {
                    let sum: i64 = weights.iter().map(|&w| i64::from(w)).sum();
                    assert!((sum - (1 << PRECISION_BITS)).abs() <= weights.len() as i64);
                }
            }
        }
    }

    /// Every filter against Pillow 11.3's `Image.resize(size, resample=n, reducing_gap=None)`
    /// of the fixture's 56×84 `square.png`, down (37×61) and up (90×130), saved as PNG: the
    /// same bytes.
    #[test]
    fn every_filter_resizes_as_pillow_does() {
        let root = env!("CARGO_MANIFEST_DIR");
        let square = image::open(format!("{root}/assets/tiny-qwen2-vl/images/square.png"))
            .unwrap()
            .to_rgb8();
        let names = ["lanczos", "bilinear", "bicubic", "box", "hamming"];
        for (number, name) in (1..=5).zip(names) {
            let filter = Resample::from_pil(number).unwrap();
            for (width, height) in [(37, 61), (90, 130)] {
                let file = format!("{root}/tests/data/square-{name}-{width}x{height}.png");
                let pillow = image::open(&file).unwrap().to_rgb8();
                let ours = resize(&square, width, height, filter);
                assert!(
                    ours == pillow,
                    "{name} to {width}×{height} differs from Pillow's"
                );
            }
        }
    }
}
