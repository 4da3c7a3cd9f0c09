//! The Qwen2-VL image processor: the same numbers as Hugging Face's PIL-flavoured
//! `Qwen2VLImageProcessor`, step by step:
//!
//! decode → RGB → smart_resize to multiples of `patch · merge` → resize (bicubic unless the
//! config names another of Pillow's filters) exactly as Pillow does it on `uint8` → ×1/255 →
//! CLIP mean/std → two identical frames → patches flattened merge-block-major, each row laid
//! out `[C][T][patch][patch]`.

mod jpeg;

use std::path::{Path, PathBuf};

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, Limits, RgbImage};
use serde::Deserialize;

/// The processor's settings, as a model folder gives them ([`PreprocessConfig::from_model_dir`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessConfig {
    /// Fewest pixels after resizing.
    pub min_pixels: usize,
    /// Most pixels after resizing.
    pub max_pixels: usize,
    /// Side of a patch.
    pub patch_size: usize,
    /// Frames per patch.
    pub temporal_patch_size: usize,
    /// Side of the block of patches the connector merges.
    pub merge_size: usize,
    /// Factor applied to the 8-bit values (1/255).
    pub rescale_factor: f64,
    /// Per-channel mean subtracted after rescaling.
    pub image_mean: [f32; 3],
    /// Per-channel standard deviation divided by after subtracting the mean.
    pub image_std: [f32; 3],
    /// The filter images are resized with.
    pub resample: Resample,
}

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

    /// How far from its centre the filter reaches, in input pixels at scale 1.
    fn support(self) -> f64 {
        match self {
            Self::Box => 0.5,
            Self::Bilinear | Self::Hamming => 1.0,
            Self::Bicubic => 2.0,
            Self::Lanczos => 3.0,
        }
    }

    /// The filter's weight at `x` (Pillow's `Resample.c`, constants as there: Hamming's are
    /// C `float`s).
    fn weight(self, x: f64) -> f64 {
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
                    (((x - 5.0) * x + 8.0) * x - 4.0) * A
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

impl Default for PreprocessConfig {
    /// `Qwen2VLImageProcessor`'s defaults.
    fn default() -> Self {
        Self {
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            rescale_factor: 1.0 / 255.0,
            image_mean: [0.481_454_66, 0.457_827_5, 0.408_210_73],
            image_std: [0.268_629_54, 0.261_302_6, 0.275_777_1],
            resample: Resample::Bicubic,
        }
    }
}

/// `preprocessor_config.json` as written by transformers (old and new spellings), or the
/// `image_processor` object of `processor_config.json`.
#[derive(Debug, Deserialize)]
struct ConfigFile {
    #[serde(default, deserialize_with = "whole_number")]
    min_pixels: Option<usize>,
    #[serde(default, deserialize_with = "whole_number")]
    max_pixels: Option<usize>,
    size: Option<SizeField>,
    patch_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    merge_size: Option<usize>,
    rescale_factor: Option<f64>,
    #[serde(default, deserialize_with = "per_channel")]
    image_mean: Option<[f32; 3]>,
    #[serde(default, deserialize_with = "per_channel")]
    image_std: Option<[f32; 3]>,
    do_resize: Option<bool>,
    do_rescale: Option<bool>,
    do_normalize: Option<bool>,
    do_convert_rgb: Option<bool>,
    /// PIL's resampling filter; 3 is bicubic.
    resample: Option<u32>,
}

/// The file holding the processor's settings in `dir` and what it says, in transformers'
/// order (see [`PreprocessConfig::from_model_dir`]); `None` when the folder has neither file.
fn settings_file(dir: &Path) -> Result<Option<(PathBuf, ConfigFile)>, PreprocessError> {
    #[derive(Deserialize)]
    struct Processor {
        image_processor: Option<ConfigFile>,
    }
    let nested = dir.join("processor_config.json");
    if let Some(processor) = read_json::<Processor>(&nested)?
        && let Some(file) = processor.image_processor
    {
        return Ok(Some((nested, file)));
    }
    let path = dir.join("preprocessor_config.json");
    match read_json(&path)? {
        Some(file) => Ok(Some((path, file))),
        None if dir.is_dir() => Ok(None),
        None => Err(PreprocessError::Io {
            path,
            source: std::io::ErrorKind::NotFound.into(),
        }),
    }
}

/// The JSON file at `path`, or `None` where there is none.
fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>, PreprocessError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(PreprocessError::Io {
                path: path.to_owned(),
                source,
            });
        }
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| PreprocessError::Config {
            path: path.to_owned(),
            source,
        })
}

#[derive(Debug, Deserialize)]
struct SizeField {
    #[serde(default, deserialize_with = "whole_number")]
    shortest_edge: Option<usize>,
    #[serde(default, deserialize_with = "whole_number")]
    longest_edge: Option<usize>,
}

/// A count of pixels, which Python may have written as a float (`3136.0`).
fn whole_number<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    let Some(number) = Option::<serde_json::Number>::deserialize(d)? else {
        return Ok(None);
    };
    if let Some(n) = number.as_u64() {
        return usize::try_from(n)
            .map(Some)
            .map_err(serde::de::Error::custom);
    }
    match number.as_f64() {
        Some(x) if x >= 0.0 && x.fract() == 0.0 && x <= u32::MAX as f64 => Ok(Some(x as usize)),
        _ => Err(serde::de::Error::custom(format!(
            "{number} is not a whole number of pixels"
        ))),
    }
}

/// One value per channel, or one for all three (which transformers broadcasts).
fn per_channel<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<[f32; 3]>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Channels {
        All(f32),
        Each(Vec<f32>),
    }
    match Option::<Channels>::deserialize(d)? {
        None => Ok(None),
        Some(Channels::All(value)) => Ok(Some([value; 3])),
        Some(Channels::Each(values)) => values.try_into().map(Some).map_err(|values: Vec<f32>| {
            serde::de::Error::custom(format!(
                "{} values, where an RGB image takes 3 (or one for all channels)",
                values.len()
            ))
        }),
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

impl PreprocessConfig {
    /// The settings in `dir` where transformers finds them: the `image_processor` object of
    /// `processor_config.json` (as transformers 5 saves a processor), else
    /// `preprocessor_config.json`, else the defaults; settings the processor cannot run are
    /// refused with their key.
    pub fn from_model_dir(dir: &Path) -> Result<Self, PreprocessError> {
        let Some((path, file)) = settings_file(dir)? else {
            return Ok(Self::default());
        };
        let config = Self::from_file(&file);
        match Self::file_problem(&file).or_else(|| config.unusable_setting()) {
            Some((key, reason)) => Err(PreprocessError::Setting { path, key, reason }),
            None => Ok(config),
        }
    }

    /// The file in `dir` that [`Self::from_model_dir`] reads the settings from, if any.
    pub fn file_in(dir: &Path) -> Option<PathBuf> {
        settings_file(dir).ok().flatten().map(|(path, _)| path)
    }

    /// The file's settings, with the defaults where it has none.
    fn from_file(file: &ConfigFile) -> Self {
        let default = Self::default();
        let size = file.size.as_ref();
        Self {
            min_pixels: file
                .min_pixels
                .or(size.and_then(|s| s.shortest_edge))
                .unwrap_or(default.min_pixels),
            max_pixels: file
                .max_pixels
                .or(size.and_then(|s| s.longest_edge))
                .unwrap_or(default.max_pixels),
            patch_size: file.patch_size.unwrap_or(default.patch_size),
            temporal_patch_size: file
                .temporal_patch_size
                .unwrap_or(default.temporal_patch_size),
            merge_size: file.merge_size.unwrap_or(default.merge_size),
            // A step switched off is the same step with factors that change nothing.
            rescale_factor: match file.do_rescale {
                Some(false) => 1.0,
                _ => file.rescale_factor.unwrap_or(default.rescale_factor),
            },
            image_mean: match file.do_normalize {
                Some(false) => [0.0; 3],
                _ => file.image_mean.unwrap_or(default.image_mean),
            },
            image_std: match file.do_normalize {
                Some(false) => [1.0; 3],
                _ => file.image_std.unwrap_or(default.image_std),
            },
            resample: file
                .resample
                .and_then(Resample::from_pil)
                .unwrap_or(default.resample),
        }
    }

    /// The first switch or `size` key of the file (key and why) that the processor cannot
    /// run, if any.
    fn file_problem(file: &ConfigFile) -> Option<(&'static str, String)> {
        let switches = [
            ("do_resize", file.do_resize),
            ("do_convert_rgb", file.do_convert_rgb),
        ];
        if let Some((key, _)) = switches.iter().find(|(_, on)| *on == Some(false)) {
            return Some((key, "is false; mmlora always runs that step".to_owned()));
        }
        if let Some(filter) = file.resample.filter(|&f| Resample::from_pil(f).is_none()) {
            return Some((
                "resample",
                format!(
                    "is {filter}; mmlora resizes with Pillow's convolution filters (1 Lanczos, \
                     2 bilinear, 3 bicubic, 4 box, 5 Hamming)"
                ),
            ));
        }
        // transformers takes `size` whole: a key it lacks is not filled in from the defaults.
        if let Some(size) = &file.size {
            let missing = [
                (
                    "shortest_edge",
                    "min_pixels",
                    size.shortest_edge,
                    file.min_pixels,
                ),
                (
                    "longest_edge",
                    "max_pixels",
                    size.longest_edge,
                    file.max_pixels,
                ),
            ];
            if let Some((edge, pixels, ..)) = missing
                .iter()
                .find(|(.., in_size, top_level)| in_size.is_none() && top_level.is_none())
            {
                return Some(("size", format!("has no {edge} (and there is no {pixels})")));
            }
        }
        None
    }

    /// The first setting (key and why) whose value the processor cannot run, if any: sizes of
    /// 0, a patch grid beyond [`MAX_FACTOR`] pixels a side or [`MAX_TEMPORAL_PATCH`] frames,
    /// `min_pixels` above an image's limit, factors that are not positive numbers. A
    /// `min_pixels` above `max_pixels` runs as in transformers: an image over `max_pixels`
    /// shrinks, any other under `min_pixels` grows.
    pub fn unusable_setting(&self) -> Option<(&'static str, String)> {
        let sizes = [
            ("min_pixels", self.min_pixels),
            ("patch_size", self.patch_size),
            ("temporal_patch_size", self.temporal_patch_size),
            ("merge_size", self.merge_size),
            ("max_pixels", self.max_pixels),
        ];
        if let Some((key, _)) = sizes.iter().find(|(_, n)| *n == 0) {
            return Some((key, "is 0".to_owned()));
        }
        let factor = self.patch_size.saturating_mul(self.merge_size);
        if factor > MAX_FACTOR {
            return Some((
                "patch_size",
                format!(
                    "{} × merge_size {} is above {MAX_FACTOR}, the widest patch grid cell the \
                     processor takes",
                    self.patch_size, self.merge_size
                ),
            ));
        }
        if self.temporal_patch_size > MAX_TEMPORAL_PATCH {
            return Some((
                "temporal_patch_size",
                format!(
                    "{} is above {MAX_TEMPORAL_PATCH}, the most frames a patch may repeat",
                    self.temporal_patch_size
                ),
            ));
        }
        if self.min_pixels as u64 > MAX_DECODED_PIXELS {
            return Some((
                "min_pixels",
                format!(
                    "{} is above the {MAX_DECODED_PIXELS} pixels an image may have",
                    self.min_pixels
                ),
            ));
        }
        if !(self.rescale_factor.is_finite() && self.rescale_factor > 0.0) {
            return Some((
                "rescale_factor",
                format!("{} is not a positive number", self.rescale_factor),
            ));
        }
        if let Some(std) = self
            .image_std
            .iter()
            .find(|s| !(s.is_finite() && **s > 0.0))
        {
            return Some(("image_std", format!("holds {std}, not a positive number")));
        }
        if let Some(mean) = self.image_mean.iter().find(|m| !m.is_finite()) {
            return Some(("image_mean", format!("holds {mean}")));
        }
        None
    }

    /// Values per patch row: channels × frames × patch².
    pub fn patch_len(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
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

/// The most pixels an image file may declare before it is decoded.
pub const MAX_DECODED_PIXELS: u64 = 64 << 20;

/// The widest `patch_size × merge_size` (pixels) a configuration may have: images are resized to
/// multiples of it, so even the smallest is that large a side (Qwen2-VL's is 28, Qwen3-VL's 32).
pub const MAX_FACTOR: usize = 1024;

/// The largest `temporal_patch_size` a configuration may have: each image's patch values are
/// repeated that many times (Qwen2-VL's is 2).
pub const MAX_TEMPORAL_PATCH: usize = 16;

/// Reads and decodes an image file (PNG, JPEG, WebP) to RGB as transformers does: grayscale is
/// replicated and transparency is composited onto white.
pub fn load_image(path: &Path) -> Result<RgbImage, PreprocessError> {
    let bytes = std::fs::read(path).map_err(|source| PreprocessError::Io {
        path: path.to_owned(),
        source,
    })?;
    let too_large = |width, height| PreprocessError::TooLarge {
        path: path.to_owned(),
        width,
        height,
        limit: MAX_DECODED_PIXELS,
    };
    let format = image::guess_format(&bytes).ok();
    if format == Some(ImageFormat::Jpeg) {
        return jpeg::decode_rgb(&bytes, MAX_DECODED_PIXELS).map_err(|error| match error {
            jpeg::JpegError::TooLarge { width, height } => too_large(width, height),
            jpeg::JpegError::Decode(reason) => PreprocessError::Decode {
                path: path.to_owned(),
                reason,
            },
        });
    }
    let decode = |source: image::ImageError| PreprocessError::Decode {
        path: path.to_owned(),
        reason: source.to_string(),
    };
    let reader = || {
        ImageReader::new(std::io::Cursor::new(&bytes[..]))
            .with_guessed_format()
            .map_err(|source| PreprocessError::Io {
                path: path.to_owned(),
                source,
            })
    };
    // The header first: refuse huge images and sample formats the reference would alter before
    // allocating for them.
    let mut decoder = reader()?.into_decoder().map_err(decode)?;
    let (width, height) = decoder.dimensions();
    if u64::from(width) * u64::from(height) > MAX_DECODED_PIXELS {
        return Err(too_large(width as usize, height as usize));
    }
    let color = decoder.color_type();
    if !matches!(color.bytes_per_pixel() / color.channel_count(), 1 | 2) {
        return Err(PreprocessError::Decode {
            path: path.to_owned(),
            reason: format!(
                "{color:?} samples are not supported (8 or 16 bits per channel only); convert \
                 the image to 8 bits per channel"
            ),
        });
    }
    let mut limits = Limits::default();
    limits.max_alloc = Some(MAX_DECODED_PIXELS * 16);
    decoder.set_limits(limits).map_err(decode)?;
    let key = match format {
        Some(ImageFormat::Png) => {
            png_colour_key(&bytes).map_err(|reason| PreprocessError::Decode {
                path: path.to_owned(),
                reason,
            })?
        }
        _ => None,
    };
    let decoded = DynamicImage::from_decoder(decoder).map_err(decode)?;
    Ok(match (key, decoded) {
        (Some(ColourKey::Gray(key)), gray) => gray_as_pillow(gray, Some(key)),
        (None, gray @ DynamicImage::ImageLuma16(_)) => gray_as_pillow(gray, None),
        (key, colour) => {
            let colour = high_bytes(colour);
            match key {
                // transformers passes RGB through, so the key colour stays as it is.
                Some(ColourKey::Rgb) => colour.to_rgb8(),
                _ if colour.color().has_alpha() => composite_on_white(&colour.to_rgba8()),
                _ => colour.to_rgb8(),
            }
        }
    })
}

/// A grayscale PNG as Pillow turns it into RGB: each sample as Pillow holds it (16 bits whole,
/// as its `I;16` mode, or 8 bits with lower depths scaled up) is white where it equals the colour
/// key and is otherwise clipped to 255.
fn gray_as_pillow(gray: DynamicImage, key: Option<u16>) -> RgbImage {
    let (width, height) = (gray.width(), gray.height());
    let samples: Vec<u16> = match gray {
        DynamicImage::ImageLuma16(_) | DynamicImage::ImageLumaA16(_) => {
            gray.into_luma16().into_raw()
        }
        other => other
            .into_luma8()
            .into_raw()
            .into_iter()
            .map(u16::from)
            .collect(),
    };
    let rgb = samples
        .into_iter()
        .flat_map(|sample| {
            let value = if Some(sample) == key {
                255
            } else {
                sample.min(255) as u8
            };
            [value; 3]
        })
        .collect();
    RgbImage::from_raw(width, height, rgb).expect("three values per pixel")
}

/// 16-bit colour samples cut to their high byte, as Pillow reads 16-bit RGB, RGBA and gray with
/// alpha PNGs; anything else is returned as it is.
fn high_bytes(image: DynamicImage) -> DynamicImage {
    let (width, height) = (image.width(), image.height());
    let cut = |raw: Vec<u16>| -> Vec<u8> { raw.into_iter().map(|v| (v >> 8) as u8).collect() };
    let whole = "the same samples, one byte each";
    match image {
        DynamicImage::ImageRgb16(b) => DynamicImage::ImageRgb8(
            image::ImageBuffer::from_raw(width, height, cut(b.into_raw())).expect(whole),
        ),
        DynamicImage::ImageRgba16(b) => DynamicImage::ImageRgba8(
            image::ImageBuffer::from_raw(width, height, cut(b.into_raw())).expect(whole),
        ),
        DynamicImage::ImageLumaA16(b) => DynamicImage::ImageLumaA8(
            image::ImageBuffer::from_raw(width, height, cut(b.into_raw())).expect(whole),
        ),
        other => other,
    }
}

/// A PNG's tRNS colour key (one colour made transparent) as Pillow reads it; `image` turns it
/// into an alpha channel, which would be composited onto white like any other.
enum ColourKey {
    /// An RGB image: Pillow opens it as RGB, which transformers passes on untouched.
    Rgb,
    /// A grayscale image: Pillow makes the 8-bit samples equal to the raw key transparent,
    /// comparing before it scales samples of 1, 2 or 4 bits (so `0` is the only key that
    /// matches at those depths).
    Gray(u16),
}

/// The colour key of the PNG in `bytes`, if it has one (palette transparency is an alpha table,
/// not a key: `image` reads it as Pillow does).
fn png_colour_key(bytes: &[u8]) -> Result<Option<ColourKey>, String> {
    let reader = png::Decoder::new(std::io::Cursor::new(bytes))
        .read_info()
        .map_err(|e| e.to_string())?;
    let info = reader.info();
    let Some(trns) = info.trns.as_deref() else {
        return Ok(None);
    };
    Ok(match (info.color_type, trns) {
        (png::ColorType::Rgb, _) => Some(ColourKey::Rgb),
        // The png crate keeps the key's low byte below 16 bits (the high byte must be 0 there).
        (png::ColorType::Grayscale, [low]) => Some(ColourKey::Gray(u16::from(*low))),
        (png::ColorType::Grayscale, [high, low, ..]) => {
            Some(ColourKey::Gray(u16::from_be_bytes([*high, *low])))
        }
        _ => None,
    })
}

/// Pillow's `alpha_composite` of an RGBA image over opaque white, then dropped to RGB: what
/// transformers' `convert_to_rgb` does with transparent images.
fn composite_on_white(image: &image::RgbaImage) -> RgbImage {
    const BITS: u32 = 7;
    let div255 = |a: u32| ((a >> 8) + a) >> 8;
    RgbImage::from_fn(image.width(), image.height(), |x, y| {
        let [r, g, b, alpha] = image.get_pixel(x, y).0;
        if alpha == 0 {
            return image::Rgb([255, 255, 255]);
        }
        let alpha = u32::from(alpha);
        // The background's alpha is 255, so Pillow's `outa255` is 255·255.
        let coef1 = alpha * 255 * 255 * (1 << BITS) / (255 * 255);
        let coef2 = 255 * (1 << BITS) - coef1;
        let blend =
            |c: u8| (div255(u32::from(c) * coef1 + 255 * coef2 + (0x80 << BITS)) >> BITS) as u8;
        image::Rgb([blend(r), blend(g), blend(b)])
    })
}

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

/// Runs the processor on one image.
pub fn preprocess(image: &RgbImage, config: &PreprocessConfig) -> Result<Patches, PreprocessError> {
    if let Some((key, reason)) = config.unusable_setting() {
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
        resize(image, width, height, config.resample)
    };

    // ×rescale_factor in f64 then f32, then (x − mean) / std in f32, as transformers' numpy path
    // does.
    let pixel = |c: usize, y: usize, x: usize| -> f32 {
        let value = resized.get_pixel(x as u32, y as u32)[c];
        let scaled = (f64::from(value) * config.rescale_factor) as f32;
        (scaled - config.image_mean[c]) / config.image_std[c]
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
fn resize(image: &RgbImage, width: usize, height: usize, filter: Resample) -> RgbImage {
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

    #[test]
    fn patches_are_merge_block_major_with_identical_frames() {
        // A 56×56 image: 4×4 patches in 2×2 merge blocks. Colour each patch by its index.
        let config = PreprocessConfig::default();
        let image = RgbImage::from_fn(56, 56, |x, y| {
            let patch = (y / 14) * 4 + x / 14;
            image::Rgb([patch as u8 * 10, 0, 0])
        });
        let patches = preprocess(&image, &config).unwrap();
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
            match preprocess(&thin, &config) {
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
