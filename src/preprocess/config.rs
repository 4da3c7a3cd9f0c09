//! The processor's settings: `preprocessor_config.json`, or the `image_processor` object of
//! `processor_config.json`, as transformers writes them (old and new spellings).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{
    ImageBackend, MAX_DECODED_PIXELS, MAX_FACTOR, MAX_TEMPORAL_PATCH, PreprocessError, Resample,
};

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
    /// Whether the mean and std step runs (`do_normalize`). Switched off, the mean is 0 and
    /// the std 1, which is the same step for the PIL backend; the torchvision backend folds
    /// the rescale into that step, so its arithmetic differs with the step off.
    pub do_normalize: bool,
    /// The filter images are resized with.
    pub resample: Resample,
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
            do_normalize: true,
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
        None if crate::vfs::is_dir(dir) => Ok(None),
        None => Err(PreprocessError::Io {
            path,
            source: std::io::ErrorKind::NotFound.into(),
        }),
    }
}

/// The JSON file at `path`, or `None` where there is none.
fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>, PreprocessError> {
    let text = match crate::vfs::read_to_string(path) {
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
            do_normalize: file.do_normalize.unwrap_or(default.do_normalize),
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

    /// The first setting (key and why) that `backend` cannot run, if any: an
    /// [`unusable_setting`](Self::unusable_setting), or a filter the backend lacks
    /// (torchvision has no box or Hamming resize).
    pub fn unusable_on(&self, backend: ImageBackend) -> Option<(&'static str, String)> {
        self.unusable_setting().or_else(|| {
            (!self.resample.runs_on(backend)).then(|| {
                (
                    "resample",
                    format!(
                        "is {:?}, which the {backend} backend cannot resize with (torch's \
                         interpolate has no such filter); use the pil backend",
                        self.resample
                    ),
                )
            })
        })
    }

    /// Values per patch row: channels × frames × patch².
    pub fn patch_len(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}
