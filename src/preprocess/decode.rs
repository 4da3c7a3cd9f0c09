//! Image files to RGB as transformers' processors get them from Pillow: PNG (colour keys and
//! 16-bit samples included), JPEG through libjpeg-turbo, WebP; grayscale replicated,
//! transparency composited onto white. On wasm32, where libjpeg-turbo's C code is not built,
//! JPEG goes through `image`'s pure-Rust decoder, which is not bit-exact with Pillow (its
//! difference on the fixture JPEGs is measured by a test below).

use std::path::Path;

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, Limits, RgbImage};

use super::PreprocessError;
#[cfg(not(target_arch = "wasm32"))]
use super::jpeg;

/// The most pixels an image file may declare before it is decoded.
pub const MAX_DECODED_PIXELS: u64 = 64 << 20;

/// Reads and decodes an image file (PNG, JPEG, WebP) to RGB as transformers does: grayscale is
/// replicated and transparency is composited onto white.
pub fn load_image(path: &Path) -> Result<RgbImage, PreprocessError> {
    let bytes = crate::vfs::read(path).map_err(|source| PreprocessError::Io {
        path: path.to_owned(),
        source,
    })?;
    decode_image(&bytes, path)
}

/// An image file's bytes decoded as [`load_image`] decodes the file (the format read from the
/// bytes, not the name); errors call the image `path`.
pub fn decode_image(bytes: &[u8], path: &Path) -> Result<RgbImage, PreprocessError> {
    let too_large = |width, height| PreprocessError::TooLarge {
        path: path.to_owned(),
        width,
        height,
        limit: MAX_DECODED_PIXELS,
    };
    let format = image::guess_format(bytes).ok();
    #[cfg(not(target_arch = "wasm32"))]
    if format == Some(ImageFormat::Jpeg) {
        return jpeg::decode_rgb(bytes, MAX_DECODED_PIXELS).map_err(|error| match error {
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
        ImageReader::new(std::io::Cursor::new(bytes))
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
            png_colour_key(bytes).map_err(|reason| PreprocessError::Decode {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `image`'s pure-Rust JPEG decoder, the wasm32 build's, against libjpeg-turbo's (Pillow's,
    /// bit for bit) on the fixture JPEGs: the difference a browser's pixels carry.
    #[test]
    fn the_pure_rust_jpeg_decoder_stays_within_a_few_levels_of_pillows() {
        let images = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-qwen2-vl/images");
        for name in ["wide.jpg", "progressive.jpg"] {
            let path = images.join(name);
            let pillow = load_image(&path).unwrap();
            let bytes = std::fs::read(&path).unwrap();
            let portable = image::load_from_memory_with_format(&bytes, ImageFormat::Jpeg)
                .unwrap()
                .to_rgb8();
            assert_eq!(pillow.dimensions(), portable.dimensions(), "{name}");
            let differences: Vec<u8> = pillow
                .as_raw()
                .iter()
                .zip(portable.as_raw())
                .map(|(a, b)| a.abs_diff(*b))
                .collect();
            let largest = differences.iter().copied().max().unwrap();
            let unequal = differences.iter().filter(|&&d| d > 0).count();
            let mean =
                differences.iter().map(|&d| f64::from(d)).sum::<f64>() / differences.len() as f64;
            println!(
                "{name}: largest {largest} levels, {unequal} of {} samples differ, mean {mean:.4}",
                differences.len()
            );
            // Measured: at most 3 levels on both (wide.jpg: 1.8 % of the samples differ, mean
            // 0.022; progressive.jpg: 23 %, mean 0.32), from the two decoders' inverse DCTs and
            // chroma upsampling; a bound of what they do, not of any arithmetic.
            assert!(largest <= 3, "{name}: {largest} levels");
        }
    }
}
