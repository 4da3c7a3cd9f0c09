//! The two 8-bit resizes behind transformers' image processors, bit for bit: Pillow's
//! `Image.resize` (the PIL backend) and torch's antialiased `interpolate` on `uint8` (the
//! torchvision backend: torchvision's `resize` hands `uint8` images to it on the CPU).
//!
//! Both are separable convolutions with fixed-point weights, a pass along each axis that
//! changes size, each pass rounding to bytes. They differ in three places: the weights'
//! fractional bits (Pillow: 22; torch: as many as keep the largest weight in an `int16`), the
//! way the bicubic filter's outer lobe is written (the same polynomial, rounded differently),
//! and the order of the passes (torch: horizontal first; Pillow 13: vertical first when the
//! height shrinks by more than twice as many pixels as the width does).

use std::borrow::Cow;

use image::RgbImage;

use super::ImageBackend;

/// Pillow's resampling filters that resize by convolution, by their `resample` numbers
/// (nearest, 0, is not one: Pillow resizes with it by another path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resample {
    /// 1.
    Lanczos,
    /// 2.
    Bilinear,
    /// 3, the processor's default.
    Bicubic,
    /// 4.
    Box,
    /// 5.
    Hamming,
}

impl Resample {
    /// The filter Pillow numbers `number`, if it resizes by convolution.
    pub fn from_pil(number: u32) -> Option<Self> {
        Some(match number {
            1 => Self::Lanczos,
            2 => Self::Bilinear,
            3 => Self::Bicubic,
            4 => Self::Box,
            5 => Self::Hamming,
            _ => return None,
        })
    }

    /// Whether `backend` resizes with this filter: torch's `interpolate` has no box or Hamming
    /// filter (torchvision raises for them).
    pub fn runs_on(self, backend: ImageBackend) -> bool {
        backend == ImageBackend::Pil || !matches!(self, Self::Box | Self::Hamming)
    }

    /// How far from its centre the filter reaches, in input pixels at scale 1.
    fn support(self) -> f64 {
        match self {
            Self::Box => 0.5,
            Self::Bilinear | Self::Hamming => 1.0,
            Self::Bicubic => 2.0,
            Self::Lanczos => 3.0,
        }
    }

    /// The filter's weight at `x` as `backend` computes it (Pillow's `Resample.c`, constants
    /// as there: Hamming's are C `float`s; torch's `UpSampleKernel.cpp` writes the bicubic
    /// outer lobe as `((a·x − 5a)·x + 8a)·x − 4a`).
    fn weight(self, x: f64, backend: ImageBackend) -> f64 {
        let sinc = |x: f64| {
            if x == 0.0 {
                1.0
            } else {
                (x * std::f64::consts::PI).sin() / (x * std::f64::consts::PI)
            }
        };
        match self {
            Self::Box => f64::from(u8::from(x > -0.5 && x <= 0.5)),
            Self::Bilinear => (1.0 - x.abs()).max(0.0),
            Self::Hamming => {
                let x = x.abs();
                if x == 0.0 {
                    1.0
                } else if x >= 1.0 {
                    0.0
                } else {
                    let x = x * std::f64::consts::PI;
                    x.sin() / x * (f64::from(0.54f32) + f64::from(0.46f32) * x.cos())
                }
            }
            Self::Bicubic => {
                const A: f64 = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    match backend {
                        ImageBackend::Pil => (((x - 5.0) * x + 8.0) * x - 4.0) * A,
                        ImageBackend::Torchvision => {
                            ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
                        }
                    }
                } else {
                    0.0
                }
            }
            Self::Lanczos => {
                if (-3.0..3.0).contains(&x) {
                    sinc(x) * sinc(x / 3.0)
                } else {
                    0.0
                }
            }
        }
    }
}

/// Pillow's fixed-point precision for 8-bit resampling.
const PILLOW_PRECISION: u32 = 32 - 8 - 2;

/// One output position: the first input it reads and the fixed-point weights of the inputs
/// from there.
struct Taps {
    first: usize,
    weights: Vec<i32>,
}

/// A resize along one axis, as fixed-point taps with `precision` fractional bits.
struct Kernel {
    taps: Vec<Taps>,
    precision: u32,
}

impl Kernel {
    /// `in_size` inputs resampled to `out_size` with `filter`, as `backend` computes the
    /// weights: in f64, normalised to sum to one, then scaled to integers rounding half away
    /// from zero (Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc`; torch's
    /// `_compute_index_ranges_int16_weights`).
    fn new(in_size: usize, out_size: usize, filter: Resample, backend: ImageBackend) -> Self {
        let scale = in_size as f64 / out_size as f64;
        let filter_scale = scale.max(1.0);
        let support = filter.support() * filter_scale;
        let inverse_scale = 1.0 / filter_scale; // multiplied, not divided, as both do
        let normalised: Vec<(usize, Vec<f64>)> = (0..out_size)
            .map(|xx| {
                let center = (xx as f64 + 0.5) * scale;
                let xmin = ((center - support + 0.5) as i64).max(0) as usize;
                let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
                let weights: Vec<f64> = (xmin..xmax)
                    .map(|x| filter.weight((x as f64 - center + 0.5) * inverse_scale, backend))
                    .collect();
                let total: f64 = weights.iter().sum();
                let weights = if total != 0.0 {
                    weights.iter().map(|w| w / total).collect()
                } else {
                    weights
                };
                (xmin, weights)
            })
            .collect();
        let precision = match backend {
            ImageBackend::Pil => PILLOW_PRECISION,
            ImageBackend::Torchvision => {
                let largest = normalised
                    .iter()
                    .flat_map(|(_, weights)| weights)
                    .fold(0.0f64, |max, &w| max.max(w));
                int16_precision(largest)
            }
        };
        let one = f64::from(1u32 << precision);
        let taps = normalised
            .into_iter()
            .map(|(first, weights)| Taps {
                first,
                weights: weights
                    .iter()
                    .map(|&w| {
                        let scaled = w * one;
                        (if scaled < 0.0 {
                            scaled - 0.5
                        } else {
                            scaled + 0.5
                        }) as i32
                    })
                    .collect(),
            })
            .collect();
        Self { taps, precision }
    }

    /// A sum of products before rounding: one half, in fixed point.
    fn half(&self) -> i32 {
        1 << (self.precision - 1)
    }

    /// A rounded sum to a byte: the fraction dropped, clamped to 0..=255.
    fn byte(&self, sum: i32) -> u8 {
        (sum >> self.precision).clamp(0, 255) as u8
    }
}

/// torch's precision for `uint8` weights: the most fractional bits (up to 22) that keep the
/// largest weight, doubled, below 2¹⁵ — so every weight fits an `int16`.
fn int16_precision(largest: f64) -> u32 {
    (0..22)
        .find(|&bits| (0.5 + largest * f64::from(1u32 << (bits + 1))) as i32 >= 1 << 15)
        .unwrap_or(22)
}

/// The horizontal pass: each row of `width` RGB pixels resampled by `kernel`.
fn horizontal(pixels: &[u8], width: usize, kernel: &Kernel) -> Vec<u8> {
    let mut out = Vec::with_capacity(pixels.len() / width * kernel.taps.len());
    for row in pixels.chunks_exact(width * 3) {
        for taps in &kernel.taps {
            let mut sums = [kernel.half(); 3];
            for (i, &k) in taps.weights.iter().enumerate() {
                let pixel = &row[(taps.first + i) * 3..][..3];
                for (sum, &value) in sums.iter_mut().zip(pixel) {
                    *sum += i32::from(value) * k;
                }
            }
            out.extend(sums.map(|sum| kernel.byte(sum)));
        }
    }
    out
}

/// The vertical pass: the rows (of `width` RGB pixels) resampled by `kernel`.
fn vertical(pixels: &[u8], width: usize, kernel: &Kernel) -> Vec<u8> {
    let stride = width * 3;
    let mut out = Vec::with_capacity(kernel.taps.len() * stride);
    let mut sums = vec![0i32; stride];
    for taps in &kernel.taps {
        sums.fill(kernel.half());
        for (i, &k) in taps.weights.iter().enumerate() {
            let row = &pixels[(taps.first + i) * stride..][..stride];
            for (sum, &value) in sums.iter_mut().zip(row) {
                *sum += i32::from(value) * k;
            }
        }
        out.extend(sums.iter().map(|&sum| kernel.byte(sum)));
    }
    out
}

/// `image` resized to `width × height` with `filter`, exactly as `backend` resizes 8-bit RGB;
/// an axis that keeps its size is not resampled. The filter must run on the backend
/// ([`Resample::runs_on`]).
pub(super) fn resize(
    image: &RgbImage,
    width: usize,
    height: usize,
    filter: Resample,
    backend: ImageBackend,
) -> RgbImage {
    let (in_width, in_height) = (image.width() as usize, image.height() as usize);
    let shrink = |from: usize, to: usize| from as i64 - to as i64;
    let vertical_first = backend == ImageBackend::Pil
        && shrink(in_height, height) > 0
        && shrink(in_height, height) > 2 * shrink(in_width, width);
    let mut pixels = Cow::Borrowed(image.as_raw().as_slice());
    let resize_width = |pixels: &mut Cow<[u8]>| {
        if width != in_width {
            let kernel = Kernel::new(in_width, width, filter, backend);
            *pixels = Cow::Owned(horizontal(pixels, in_width, &kernel));
        }
    };
    // The width the vertical pass sees: the input's when it runs first.
    let resize_height = |pixels: &mut Cow<[u8]>, row_width: usize| {
        if height != in_height {
            let kernel = Kernel::new(in_height, height, filter, backend);
            *pixels = Cow::Owned(vertical(pixels, row_width, &kernel));
        }
    };
    if vertical_first {
        resize_height(&mut pixels, in_width);
        resize_width(&mut pixels);
    } else {
        resize_width(&mut pixels);
        resize_height(&mut pixels, width);
    }
    RgbImage::from_raw(width as u32, height as u32, pixels.into_owned())
        .expect("the passes make width × height pixels")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_in_fixed_point() {
        for backend in [ImageBackend::Pil, ImageBackend::Torchvision] {
            for filter in (1..=5).filter_map(Resample::from_pil) {
                if !filter.runs_on(backend) {
                    continue;
                }
                for (inp, out) in [(100, 56), (56, 100), (37, 28), (28, 28)] {
                    let kernel = Kernel::new(inp, out, filter, backend);
                    for taps in &kernel.taps {
                        let sum: i64 = taps.weights.iter().map(|&w| i64::from(w)).sum();
                        let one = 1i64 << kernel.precision;
                        assert!((sum - one).abs() <= taps.weights.len() as i64);
                    }
                }
            }
        }
    }

    #[test]
    fn torch_weights_fit_int16() {
        // 2 × 1.0 · 2¹⁴ reaches 2¹⁵; 2 × 0.25 · 2¹⁶ does.
        assert_eq!(int16_precision(1.0), 14);
        assert_eq!(int16_precision(0.25), 16);
        for filter in [Resample::Bilinear, Resample::Bicubic, Resample::Lanczos] {
            for (inp, out) in [(100, 56), (56, 100), (640, 28), (28, 640)] {
                let kernel = Kernel::new(inp, out, filter, ImageBackend::Torchvision);
                let widest = kernel.taps.iter().flat_map(|t| &t.weights).map(|w| w.abs());
                assert!(widest.max().unwrap() < 1 << 15, "{filter:?} {inp}→{out}");
            }
        }
    }

    /// `square.png` (56×84) resized as Pillow 13 and torchvision 0.29 (torch 2.15 on x86-64)
    /// resize it, saved as PNG: `tests/data/square-{backend}-{filter}-{w}x{h}.png`, written by
    /// `tools/make_fixtures.py`. Sizes: both axes down (37×61), both up (90×130), the height
    /// down more than twice the width (50×40: Pillow 13 runs the vertical pass first) and the
    /// height down while the width grows (70×60).
    #[test]
    fn every_filter_resizes_as_each_backend_does() {
        let root = env!("CARGO_MANIFEST_DIR");
        let square = image::open(format!("{root}/assets/tiny-qwen2-vl/images/square.png"))
            .unwrap()
            .to_rgb8();
        let names = ["lanczos", "bilinear", "bicubic", "box", "hamming"];
        for backend in [ImageBackend::Pil, ImageBackend::Torchvision] {
            for (number, name) in (1..=5).zip(names) {
                let filter = Resample::from_pil(number).unwrap();
                if !filter.runs_on(backend) {
                    continue;
                }
                for (width, height) in [(37, 61), (90, 130), (50, 40), (70, 60)] {
                    let file =
                        format!("{root}/tests/data/square-{backend}-{name}-{width}x{height}.png");
                    let reference = image::open(&file).unwrap().to_rgb8();
                    let ours = resize(&square, width, height, filter, backend);
                    assert!(
                        ours == reference,
                        "{backend} {name} to {width}×{height} differs from {file}"
                    );
                }
            }
        }
    }
}
