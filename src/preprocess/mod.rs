//! The Qwen2-VL image processor (which Qwen2.5-VL and Qwen3-VL share): the same numbers as
//! transformers' `Qwen2VLImageProcessor` with either of its backends, step by step:
//!
//! decode → RGB → smart_resize to multiples of `patch · merge` → resize (bicubic unless the
//! config names another filter) on `uint8` exactly as the backend does it (torch's
//! antialiased `interpolate`, or Pillow) → rescale and normalise in the backend's order of
//! operations → identical frames → patches flattened merge-block-major, each row laid out
//! `[C][T][patch][patch]`.
//!
//! By job: `config` reads the processor's settings, `decode` turns files into RGB as
//! Pillow does, `resample` resizes as each backend does; this file cuts the patches.

mod config;
mod decode;
#[cfg(not(target_arch = "wasm32"))]
mod jpeg;
mod resample;

use std::path::{Path, PathBuf};

use image::RgbImage;

use crate::named::named_choice;
pub use config::PreprocessConfig;
pub use decode::{MAX_DECODED_PIXELS, decode_image, load_image};
pub use resample::Resample;
use resample::resize;

named_choice! {
    /// Which of transformers' image-processor backends to reproduce. They decode alike and
    /// differ in the resize (one 8-bit level here and there on downscales; more where Pillow 13
    /// runs its passes in the other order) and in the float arithmetic of the normalisation.
    #[derive(Default)]
    pub enum ImageBackend {
        /// torchvision's, which `AutoImageProcessor` and `AutoProcessor` load in transformers 5
        /// wherever torchvision is installed (vLLM's CUDA requirements pin it): torch's
        /// antialiased resize on `uint8`.
        #[default]
        Torchvision,
        /// Pillow's: `backend="pil"` in transformers 5, transformers 4's `Qwen2VLImageProcessor`;
        /// Pillow 13's resize.
        Pil,
    }
}

/// Errors reading images or processor settings.
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The image could not be decoded (or is larger than the decoder's limits).
    #[error("cannot decode image {path}: {reason}")]
    Decode {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The image has more pixels than allowed before decoding.
    #[error("image {path} is {width}×{height}, above the limit of {limit} pixels")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its width.
        width: usize,
        /// Its height.
        height: usize,
        /// The limit.
        limit: u64,
    },
    /// The image's shape cannot be resized to patches.
    #[error("image of {width}×{height} cannot be processed: {reason}")]
    Shape {
        /// Its width.
        width: usize,
        /// Its height.
        height: usize,
        /// Why.
        reason: &'static str,
    },
    /// The image in a file has a shape that cannot be resized to patches.
    #[error("image {path} is {width}×{height} and cannot be processed: {reason}")]
    FileShape {
        /// The file.
        path: PathBuf,
        /// Its width.
        width: usize,
        /// Its height.
        height: usize,
        /// Why.
        reason: &'static str,
    },
    /// `preprocessor_config.json` is malformed.
    #[error("malformed {path}: {source}")]
    Config {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
    /// A processor configuration built in memory holds a value the processor cannot run.
    #[error("image processor setting `{key}` {reason}")]
    Unusable {
        /// The setting.
        key: &'static str,
        /// Why.
        reason: String,
    },
    /// `preprocessor_config.json` holds a value the processor cannot run.
    #[error("{path}: `{key}` {reason}")]
    Setting {
        /// The file.
        path: PathBuf,
        /// The key.
        key: &'static str,
        /// Why.
        reason: String,
    },
}

impl PreprocessError {
    /// The error naming the file the image came from, where it did not already.
    pub fn in_file(self, path: &Path) -> Self {
        match self {
            Self::Shape {
                width,
                height,
                reason,
            } => Self::FileShape {
                path: path.to_owned(),
                width,
                height,
                reason,
            },
            other => other,
        }
    }
}

/// One image as the tower takes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Patches {
    /// `[rows, patch_len]`, row-major.
    pub pixel_values: Vec<f32>,
    /// `(t, h, w)` in patches.
    pub grid_thw: [usize; 3],
}

impl Patches {
    /// Rows (patches); `usize::MAX` for a grid whose product overflows, which no pixel buffer
    /// can match.
    pub fn rows(&self) -> usize {
        grid_rows(&self.grid_thw)
    }
}

/// The rows of a `(t, h, w)` grid, saturating at `usize::MAX` where the product overflows (a
/// grid given by a caller is checked against its pixel values with this).
pub fn grid_rows(grid_thw: &[usize; 3]) -> usize {
    grid_thw.iter().fold(1, |rows, &n| rows.saturating_mul(n))
}

/// The widest `patch_size × merge_size` (pixels) a configuration may have: images are resized to
/// multiples of it, so even the smallest is that large a side (Qwen2-VL's is 28, Qwen3-VL's 32).
pub const MAX_FACTOR: usize = 1024;

/// The largest `temporal_patch_size` a configuration may have: each image's patch values are
/// repeated that many times (Qwen2-VL's is 2).
pub const MAX_TEMPORAL_PATCH: usize = 16;

/// The size an image is resized to: each side a multiple of `factor`, the area within
/// `[min_pixels, max_pixels]`, rounding as Python's `round` (halves to even).
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize), PreprocessError> {
    let shape_error = |reason| PreprocessError::Shape {
        width,
        height,
        reason,
    };
    if height == 0 || width == 0 {
        return Err(shape_error("an image needs at least one pixel"));
    }
    if height.max(width) as f64 / height.min(width) as f64 > 200.0 {
        return Err(shape_error("the aspect ratio is above 200"));
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let mut h_bar = (h / f).round_ties_even() * f;
    let mut w_bar = (w / f).round_ties_even() * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = (h * w / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as usize, w_bar as usize))
}

/// Runs the processor on one image, as `backend` does.
pub fn preprocess(
    image: &RgbImage,
    config: &PreprocessConfig,
    backend: ImageBackend,
) -> Result<Patches, PreprocessError> {
    if let Some((key, reason)) = config.unusable_on(backend) {
        return Err(PreprocessError::Unusable { key, reason });
    }
    let factor = config.patch_size * config.merge_size;
    let (height, width) = smart_resize(
        image.height() as usize,
        image.width() as usize,
        factor,
        config.min_pixels,
        config.max_pixels,
    )?;
    let resized = if (width, height) == (image.width() as usize, image.height() as usize) {
        image.clone()
    } else {
        resize(image, width, height, config.resample, backend)
    };
    let values = normalised_values(config, backend);
    let pixel = |c: usize, y: usize, x: usize| -> f32 {
        values[c][usize::from(resized.get_pixel(x as u32, y as u32)[c])]
    };

    let (p, t, m) = (
        config.patch_size,
        config.temporal_patch_size,
        config.merge_size,
    );
    let (gh, gw) = (height / p, width / p);
    let mut pixel_values = Vec::with_capacity(gh * gw * config.patch_len());
    // Each patch row is [C][T][p][p], the T frames identical.
    for [_, row, column] in patch_positions([1, gh, gw], m) {
        let (py, px) = (row * p, column * p);
        for c in 0..3 {
            for _frame in 0..t {
                for y in 0..p {
                    for x in 0..p {
                        pixel_values.push(pixel(c, py + y, px + x));
                    }
                }
            }
        }
    }
    Ok(Patches {
        pixel_values,
        grid_thw: [1, gh, gw],
    })
}

/// Each channel's value for each byte, in `backend`'s arithmetic:
/// - PIL (numpy): × `rescale_factor` in f64, then f32; (x − mean) / std in f32.
/// - torchvision: the rescale folded into the normalisation, mean and std in f32 each times
///   the f32 of 1 / `rescale_factor`, then (x − mean′) / std′ in f32; with the normalisation
///   off, x × the f32 of `rescale_factor`.
fn normalised_values(config: &PreprocessConfig, backend: ImageBackend) -> [[f32; 256]; 3] {
    let rescale = config.rescale_factor;
    std::array::from_fn(|c| {
        let (mean, std) = (config.image_mean[c], config.image_std[c]);
        std::array::from_fn(|byte| match backend {
            ImageBackend::Pil => ((byte as f64 * rescale) as f32 - mean) / std,
            ImageBackend::Torchvision if config.do_normalize => {
                let inverse = (1.0 / rescale) as f32;
                (byte as f32 - mean * inverse) / (std * inverse)
            }
            ImageBackend::Torchvision => byte as f32 * rescale as f32,
        })
    })
}

/// Where each patch row (and so each tower row) of an image with grid `(t, h, w)` sits, as
/// `[frame, patch row, patch column]`. Rows are merge-block-major: the `merge × merge` blocks in
/// raster order, the patches of a block in raster order; the connector merges each block.
pub fn patch_positions([t, h, w]: [usize; 3], merge: usize) -> Vec<[usize; 3]> {
    let mut positions = Vec::with_capacity(t * h * w);
    for frame in 0..t {
        for block_row in 0..h / merge {
            for block_column in 0..w / merge {
                for row in 0..merge {
                    for column in 0..merge {
                        positions.push([
                            frame,
                            block_row * merge + row,
                            block_column * merge + column,
                        ]);
                    }
                }
            }
        }
    }
    positions
}

#[cfg(test)]
mod tests {
    #[test]
    fn patch_positions_are_merge_block_major() {
        let positions = patch_positions([1, 4, 6], 2);
        assert_eq!(positions.len(), 24);
        assert_eq!(
            positions[..6],
            [
                [0, 0, 0],
                [0, 0, 1],
                [0, 1, 0],
                [0, 1, 1],
                [0, 0, 2],
                [0, 0, 3]
            ]
        );
        assert_eq!(positions[12], [0, 2, 0]); // the second row of blocks
        let mut sorted = positions.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 24, "every patch exactly once");
    }

    use super::*;

    #[test]
    fn smart_resize_rounds_halves_to_even_and_keeps_the_pixel_range() {
        // 42/28 = 1.5 → 2 (even); 70/28 = 2.5 → 2 (even), as Python's round.
        assert_eq!(smart_resize(42, 70, 28, 1, 1 << 30).unwrap(), (56, 56));
        assert_eq!(
            smart_resize(224, 224, 28, 3136, 1_003_520).unwrap(),
            (224, 224)
        );
        // Too many pixels: scaled down, floored to multiples of 28.
        let (h, w) = smart_resize(1000, 1000, 28, 3136, 200_000).unwrap();
        assert!(h * w <= 200_000 && h % 28 == 0 && w % 28 == 0, "{h}×{w}");
        // Too few: scaled up, ceiled.
        let (h, w) = smart_resize(30, 30, 28, 3136, 1_003_520).unwrap();
        assert!(h * w >= 3136 && h % 28 == 0, "{h}×{w}");
        // min_pixels above max_pixels, as transformers takes it: over the maximum shrinks
        // (and stays under it), anything else under the minimum grows past it.
        let (min, max) = (28 * 28 * 20, 28 * 28 * 8);
        let (h, w) = smart_resize(1000, 1000, 28, min, max).unwrap();
        assert!(h * w <= max, "{h}×{w}");
        let (h, w) = smart_resize(56, 56, 28, min, max).unwrap();
        assert!(h * w >= min, "{h}×{w}");
        assert!(smart_resize(10, 3000, 28, 3136, 1_003_520).is_err());
        assert!(smart_resize(0, 30, 28, 3136, 1_003_520).is_err());
    }

    #[test]
    fn patches_are_merge_block_major_with_identical_frames() {
        // A 56×56 image: 4×4 patches in 2×2 merge blocks. Colour each patch by its index.
        let config = PreprocessConfig::default();
        let image = RgbImage::from_fn(56, 56, |x, y| {
            let patch = (y / 14) * 4 + x / 14;
            image::Rgb([patch as u8 * 10, 0, 0])
        });
        let patches = preprocess(&image, &config, ImageBackend::Pil).unwrap();
        assert_eq!(patches.grid_thw, [1, 4, 4]);
        let red = |row: usize| patches.pixel_values[row * config.patch_len()];
        let expected_patch_order = [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15];
        for (row, &patch) in expected_patch_order.iter().enumerate() {
            let value =
                ((patch as f64 * 10.0 / 255.0) as f32 - config.image_mean[0]) / config.image_std[0];
            assert_eq!(red(row), value, "row {row}");
        }
        // The two frames of a patch are equal.
        let frame = 14 * 14;
        assert_eq!(
            patches.pixel_values[..frame],
            patches.pixel_values[frame..2 * frame]
        );
    }

    /// With a step switched off, each backend's arithmetic as transformers 5.23 runs it: the
    /// sum of the pixel values' bit patterns (mod 2³²) for a 56×56 image holding every byte in
    /// each channel, from `Qwen2VLImageProcessor` (torchvision 0.29.2) and
    /// `Qwen2VLImageProcessorPil` (Pillow 13) with `do_normalize=False` or `do_rescale=False`.
    /// The backends differ with the normalisation off (torchvision multiplies by the f32 of
    /// 1/255, numpy in f64) and agree with the rescale off.
    #[test]
    fn switched_off_steps_compute_as_each_backend_does() {
        let image = RgbImage::from_fn(56, 56, |x, y| {
            let r = ((x + 56 * y) % 256) as u8;
            image::Rgb([r, 255 - r, r.wrapping_mul(7)])
        });
        let no_normalize = PreprocessConfig {
            image_mean: [0.0; 3],
            image_std: [1.0; 3],
            do_normalize: false,
            ..PreprocessConfig::default()
        };
        let no_rescale = PreprocessConfig {
            rescale_factor: 1.0,
            ..PreprocessConfig::default()
        };
        for (config, backend, transformers) in [
            (&no_normalize, ImageBackend::Torchvision, 293_385_086u32),
            (&no_normalize, ImageBackend::Pil, 293_375_768),
            (&no_rescale, ImageBackend::Torchvision, 1_317_071_824),
            (&no_rescale, ImageBackend::Pil, 1_317_071_824),
        ] {
            let patches = preprocess(&image, config, backend).unwrap();
            let sum = patches
                .pixel_values
                .iter()
                .fold(0u32, |sum, v| sum.wrapping_add(v.to_bits()));
            assert_eq!(sum, transformers, "{backend}, {config:?}");
        }
    }

    /// A one-row PNG of `color` and `depth` holding `data`, with the tRNS chunk `trns` unless
    /// it is empty.
    fn png_with_key(
        width: u32,
        color: png::ColorType,
        depth: png::BitDepth,
        data: &[u8],
        trns: &[u8],
    ) -> tempfile::NamedTempFile {
        let file = tempfile::Builder::new().suffix(".png").tempfile().unwrap();
        let mut encoder = png::Encoder::new(file.reopen().unwrap(), width, 1);
        encoder.set_color(color);
        encoder.set_depth(depth);
        if !trns.is_empty() {
            encoder.set_trns(trns.to_vec());
        }
        encoder
            .write_header()
            .unwrap()
            .write_image_data(data)
            .unwrap();
        file
    }

    /// The red channel of each pixel of the row.
    fn reds(image: &RgbImage) -> Vec<u8> {
        image.pixels().map(|p| p.0[0]).collect()
    }

    #[test]
    fn colour_keys_are_read_as_pillow_reads_them() {
        use png::{BitDepth, ColorType};
        // Each expected row is what Pillow 11.3 and transformers' convert_to_rgb give.
        // 2-bit gray 0, 1, 2, 3: only key 0 matches a scaled sample (0, 85, 170, 255).
        let two_bit = [0b0001_1011];
        for (key, expected) in [(0, [255, 85, 170, 255]), (1, [0, 85, 170, 255])] {
            let file = png_with_key(4, ColorType::Grayscale, BitDepth::Two, &two_bit, &[0, key]);
            assert_eq!(
                reds(&load_image(file.path()).unwrap()),
                expected,
                "key {key}"
            );
        }
        // 8-bit gray: the sample equal to the key turns white.
        let file = png_with_key(
            4,
            ColorType::Grayscale,
            BitDepth::Eight,
            &[0, 7, 100, 255],
            &[0, 7],
        );
        assert_eq!(reds(&load_image(file.path()).unwrap()), [0, 255, 100, 255]);
        // RGB: Pillow opens it as RGB, and transformers leaves RGB images alone.
        let file = png_with_key(
            2,
            ColorType::Rgb,
            BitDepth::Eight,
            &[10, 20, 30, 1, 2, 3],
            &[0, 10, 0, 20, 0, 30],
        );
        let image = load_image(file.path()).unwrap();
        assert_eq!(image.as_raw(), &[10, 20, 30, 1, 2, 3]);
    }

    #[test]
    fn sixteen_bit_pngs_are_read_as_pillow_reads_them() {
        use png::{BitDepth, ColorType};
        let be =
            |samples: &[u16]| -> Vec<u8> { samples.iter().flat_map(|s| s.to_be_bytes()).collect() };
        let rgb = |width: u32, color, samples: &[u16], trns: &[u16]| {
            let file = png_with_key(width, color, BitDepth::Sixteen, &be(samples), &be(trns));
            load_image(file.path()).unwrap().into_raw()
        };
        // Each expected row is what Pillow 11.3 and transformers' convert_to_rgb give.
        // Gray: Pillow's I;16, clipped to 255; the key compared with the whole sample.
        let gray = [0, 100, 255, 256, 1000, 40000, 65535];
        let clipped: Vec<u8> = [0, 100, 255, 255, 255, 255, 255]
            .iter()
            .flat_map(|&v| [v; 3])
            .collect();
        assert_eq!(rgb(7, ColorType::Grayscale, &gray, &[]), clipped);
        let keyed: Vec<u8> = [0, 255, 255, 255].iter().flat_map(|&v| [v; 3]).collect();
        assert_eq!(
            rgb(4, ColorType::Grayscale, &[0, 100, 1000, 40000], &[100]),
            keyed
        );
        // Colour: the high byte of each sample, alpha composited onto white.
        assert_eq!(
            rgb(
                2,
                ColorType::Rgb,
                &[1000, 40000, 65535, 200, 300, 65280],
                &[]
            ),
            [3, 156, 255, 0, 1, 255]
        );
        assert_eq!(
            rgb(
                2,
                ColorType::Rgba,
                &[1000, 40000, 65535, 32768, 200, 300, 65280, 65535],
                &[]
            ),
            [129, 205, 255, 0, 1, 255]
        );
        assert_eq!(
            rgb(1, ColorType::GrayscaleAlpha, &[40000, 32768], &[]),
            [205; 3]
        );
        // An RGB colour key: the image stays RGB.
        assert_eq!(
            rgb(2, ColorType::Rgb, &[1000, 2, 3, 40000, 5, 6], &[1000, 2, 3]),
            [3, 0, 0, 156, 0, 0]
        );
    }

    /// Where transformers reads the settings, and the spellings it takes.
    #[test]
    fn processor_settings_are_read_as_transformers_reads_them() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, json: &str| std::fs::write(dir.path().join(name), json).unwrap();
        let read = || PreprocessConfig::from_model_dir(dir.path());
        write("preprocessor_config.json", r#"{"max_pixels": 12845056}"#);
        // A processor saved by transformers 5 nests its image processor's settings; they win
        // over an older preprocessor_config.json beside them.
        write(
            "processor_config.json",
            r#"{"image_processor": {"size": {"shortest_edge": 3136.0, "longest_edge": 9408.0},
                "image_mean": 0.5, "image_std": [0.25, 0.5, 1.0]}, "processor_class": "Qwen2VLProcessor"}"#,
        );
        let config = read().unwrap();
        assert_eq!((config.min_pixels, config.max_pixels), (3136, 9408));
        assert_eq!(
            (config.image_mean, config.image_std),
            ([0.5; 3], [0.25, 0.5, 1.0])
        );
        // Without nested settings, processor_config.json is not the image processor's.
        write(
            "processor_config.json",
            r#"{"processor_class": "Qwen2VLProcessor"}"#,
        );
        assert_eq!(read().unwrap().max_pixels, 12845056);
        // Steps switched off are factors that change nothing.
        write(
            "preprocessor_config.json",
            r#"{"do_rescale": false, "do_normalize": false, "rescale_factor": 0.5,
                "resample": 2}"#,
        );
        let config = read().unwrap();
        assert_eq!(config.rescale_factor, 1.0);
        assert_eq!(config.resample, Resample::Bilinear);
        assert_eq!((config.image_mean, config.image_std), ([0.0; 3], [1.0; 3]));
        // Malformed values are refused naming the file and saying why.
        for (json, why) in [
            (r#"{"image_mean": [0.5, 0.5, 0.5, 0.5]}"#, "4 values"),
            (r#"{"max_pixels": 3136.5}"#, "not a whole number"),
        ] {
            write("preprocessor_config.json", json);
            let error = read().unwrap_err().to_string();
            assert!(
                error.contains("preprocessor_config.json") && error.contains(why),
                "{json}: {error}"
            );
        }
    }

    #[test]
    fn processor_settings_it_cannot_run_are_refused_by_key() {
        let dir = tempfile::tempdir().unwrap();
        let read = |json: &str| {
            std::fs::write(dir.path().join("preprocessor_config.json"), json).unwrap();
            PreprocessConfig::from_model_dir(dir.path())
        };
        for (json, key) in [
            (r#"{"resample": 0}"#, "resample"),
            (r#"{"do_resize": false}"#, "do_resize"),
            (r#"{"do_convert_rgb": false}"#, "do_convert_rgb"),
            (r#"{"size": {"shortest_edge": 3136}}"#, "size"),
            (r#"{"min_pixels": 0}"#, "min_pixels"),
            (r#"{"merge_size": 0}"#, "merge_size"),
            (r#"{"patch_size": 100000}"#, "patch_size"),
            (r#"{"patch_size": 9223372036854775807}"#, "patch_size"),
            (
                r#"{"temporal_patch_size": 1000000000}"#,
                "temporal_patch_size",
            ),
            (r#"{"image_std": [0.2, 0.0, 0.2]}"#, "image_std"),
        ] {
            match read(json) {
                Err(PreprocessError::Setting { key: refused, .. }) => {
                    assert_eq!(refused, key, "{json}")
                }
                other => panic!("{json}: {other:?}"),
            }
        }
        // Built in memory, the same values are refused by preprocess itself, not a panic (a
        // height of 10 rounds to 0 rows of 28 pixels, which min_pixels 0 would let through).
        let thin = RgbImage::new(100, 10);
        for config in [
            PreprocessConfig {
                min_pixels: 0,
                ..PreprocessConfig::default()
            },
            PreprocessConfig {
                patch_size: 0,
                ..PreprocessConfig::default()
            },
            PreprocessConfig {
                temporal_patch_size: 1 << 30,
                ..PreprocessConfig::default()
            },
        ] {
            match preprocess(&thin, &config, ImageBackend::default()) {
                Err(PreprocessError::Unusable { .. }) => {}
                other => panic!("{config:?}: {other:?}"),
            }
        }
        // What transformers reads: top-level min/max over `size`, which then may lack them.
        let config = read(r#"{"size": {"shortest_edge": 1}, "max_pixels": 5000, "resample": 3}"#);
        let config = config.unwrap();
        assert_eq!((config.min_pixels, config.max_pixels), (1, 5000));
        // No file in the folder: the defaults; no folder: an error naming the file.
        std::fs::remove_file(dir.path().join("preprocessor_config.json")).unwrap();
        assert_eq!(
            PreprocessConfig::from_model_dir(dir.path()).unwrap(),
            PreprocessConfig::default()
        );
        let missing = dir.path().join("missing");
        let error = PreprocessConfig::from_model_dir(&missing).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("missing/preprocessor_config.json"),
            "{error}"
        );
    }
}
