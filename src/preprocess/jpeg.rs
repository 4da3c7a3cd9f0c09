//! JPEG decoding with libjpeg-turbo's own C code (through `mozjpeg`), so the pixels are
//! bit-exact with Pillow's (libjpeg-turbo, ISLOW IDCT, fancy upsampling: the defaults of both).
//! Pure-Rust decoders use other IDCTs and upsamplers and differ by one to twenty levels.
//!
//! libjpeg reports fatal errors through a callback that must not return; ours unwinds with the
//! message (no panic hook runs), and [`decode_rgb`] turns that into an `Err`. Warnings are
//! ignored as Pillow ignores them, except "premature end of data", which Pillow refuses as a
//! truncated image.

use std::os::raw::c_int;

use image::RgbImage;
use mozjpeg::{ColorSpace, Decompress};
use mozjpeg_sys::{JWRN_JPEG_EOF, jpeg_common_struct, jpeg_error_mgr, jpeg_std_error};

/// libjpeg's `JMSG_LENGTH_MAX`.
const MESSAGE_LEN: usize = 80;

/// Why a JPEG was not decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JpegError {
    /// The header declares more pixels than allowed.
    TooLarge {
        /// Declared width.
        width: usize,
        /// Declared height.
        height: usize,
    },
    /// libjpeg refused the data.
    Decode(String),
}

/// Decodes JPEG bytes to RGB exactly as Pillow's `Image.open(f).convert("RGB")` does
/// (grayscale replicated, CMYK/YCCK through Pillow's inverted-CMYK conversion), refusing
/// images whose header declares more than `max_pixels` before decoding them.
pub fn decode_rgb(data: &[u8], max_pixels: u64) -> Result<RgbImage, JpegError> {
    let decoded = std::panic::catch_unwind(|| -> std::io::Result<Result<_, JpegError>> {
        // SAFETY: `jpeg_std_error` fills every field of the zeroed struct.
        let mut errors: jpeg_error_mgr = unsafe { std::mem::zeroed() };
        unsafe { jpeg_std_error(&mut errors) };
        errors.error_exit = Some(error_exit);
        errors.emit_message = Some(emit_message);
        let header = Decompress::with_err(errors).from_mem(data)?;
        let (width, height) = header.size();
        if width as u64 * height as u64 > max_pixels {
            return Ok(Err(JpegError::TooLarge { width, height }));
        }
        let cmyk = matches!(
            header.color_space(),
            ColorSpace::JCS_CMYK | ColorSpace::JCS_YCCK
        );
        let mut image = if cmyk {
            header.to_colorspace(ColorSpace::JCS_CMYK)?
        } else {
            header.rgb()?
        };
        let (width, height) = (image.width(), image.height());
        let pixels: Vec<u8> = image.read_scanlines()?;
        image.finish()?;
        let pixels = if cmyk {
            inverted_cmyk_to_rgb(&pixels)
        } else {
            pixels
        };
        Ok(RgbImage::from_raw(width as u32, height as u32, pixels)
            .ok_or_else(|| JpegError::Decode("libjpeg returned too few pixels".to_owned())))
    });
    match decoded {
        Ok(Ok(result)) => result,
        Ok(Err(error)) => Err(JpegError::Decode(error.to_string())),
        Err(payload) => Err(JpegError::Decode(
            payload
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_else(|| "libjpeg failed".to_owned()),
        )),
    }
}

/// libjpeg's text for the error or warning it is reporting.
fn message(cinfo: &mut jpeg_common_struct) -> String {
    let mut buffer = [0u8; MESSAGE_LEN];
    // SAFETY: libjpeg sets `err` before any callback runs.
    if let Some(format) = unsafe { (*cinfo.err).format_message } {
        // The binding declares the buffer `&[u8; 80]`, but libjpeg writes the message into it.
        let format: unsafe extern "C-unwind" fn(&mut jpeg_common_struct, &mut [u8; MESSAGE_LEN]) =
            unsafe { std::mem::transmute(format) };
        unsafe { format(cinfo, &mut buffer) };
    }
    let end = buffer.iter().position(|&b| b == 0).unwrap_or(MESSAGE_LEN);
    String::from_utf8_lossy(&buffer[..end]).into_owned()
}

/// libjpeg's fatal-error callback: unwinds out of the decoder with the message.
extern "C-unwind" fn error_exit(cinfo: &mut jpeg_common_struct) {
    std::panic::resume_unwind(Box::new(message(cinfo)));
}

/// libjpeg's message callback: a truncated file is an error (as in Pillow), the rest is ignored.
extern "C-unwind" fn emit_message(cinfo: &mut jpeg_common_struct, level: c_int) {
    // SAFETY: as in `message`.
    let code = unsafe { (*cinfo.err).msg_code };
    if level < 0 && code == JWRN_JPEG_EOF as c_int {
        std::panic::resume_unwind(Box::new(message(cinfo)));
    }
}

/// Pillow's reading of Adobe JPEG CMYK (stored inverted, raw mode `CMYK;I`) followed by its
/// `cmyk2rgb`: `255 - min(255, c' + k')` with the fixed-point multiply Pillow uses.
fn inverted_cmyk_to_rgb(cmyk: &[u8]) -> Vec<u8> {
    let mul_div_255 = |a: i32, b: i32| {
        let t = a * b + 128;
        ((t >> 8) + t) >> 8
    };
    cmyk.chunks_exact(4)
        .flat_map(|p| {
            let k = i32::from(p[3]);
            [0, 1, 2].map(|i| (k - mul_div_255(255 - i32::from(p[i]), k)).clamp(0, 255) as u8)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_and_truncated_files_are_errors() {
        assert!(decode_rgb(b"not a jpeg at all", 1 << 20).is_err());
        let file = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/assets/tiny-qwen2-vl/images/wide.jpg"
        ))
        .unwrap();
        let whole = decode_rgb(&file, 1 << 20).unwrap();
        assert_eq!(whole.dimensions(), (150, 100));
        match decode_rgb(&file[..file.len() / 2], 1 << 20) {
            Err(JpegError::Decode(message)) => {
                assert!(message.contains("Premature end"), "{message}")
            }
            other => panic!("a truncated file decoded: {other:?}"),
        }
        assert_eq!(
            decode_rgb(&file, 14_999),
            Err(JpegError::TooLarge {
                width: 150,
                height: 100
            })
        );
    }

    /// `jpegtran -arithmetic` of the bundled JPEGs (baseline and progressive): the same DCT
    /// coefficients, entropy-coded arithmetically, so the same pixels exactly.
    #[test]
    fn arithmetic_coded_files_decode_to_the_same_pixels() {
        let root = env!("CARGO_MANIFEST_DIR");
        for (huffman, arithmetic) in [
            (
                "assets/tiny-qwen2-vl/images/wide.jpg",
                "tests/data/wide-arithmetic.jpg",
            ),
            (
                "assets/tiny-qwen2-vl/images/progressive.jpg",
                "tests/data/progressive-arithmetic.jpg",
            ),
        ] {
            let decode = |file: &str| {
                let bytes = std::fs::read(format!("{root}/{file}")).unwrap();
                decode_rgb(&bytes, 1 << 20).unwrap_or_else(|e| panic!("{file}: {e:?}"))
            };
            assert!(
                decode(huffman) == decode(arithmetic),
                "{arithmetic} differs"
            );
        }
    }

    /// A grayscale and an Adobe CMYK JPEG written by Pillow 11.3, and an Adobe YCCK one
    /// (transform 2, progressive, its chroma subsampled 2×2; written by libjpeg through
    /// `mozjpeg`'s `Compress` from CMYK with `set_color_space(JCS_YCCK)`, since Pillow writes
    /// none), each against Pillow 11.3's own `Image.open(f).convert("RGB")` saved as PNG beside
    /// it (Pillow 13 converts them to the same pixels): the same pixels exactly.
    #[test]
    fn grayscale_cmyk_and_ycck_decode_as_pillow_converts_them() {
        let root = env!("CARGO_MANIFEST_DIR");
        for name in ["gray", "cmyk", "ycck"] {
            let jpeg = std::fs::read(format!("{root}/tests/data/{name}.jpg")).unwrap();
            let ours = decode_rgb(&jpeg, 1 << 20).unwrap_or_else(|e| panic!("{name}: {e:?}"));
            let pillow = image::open(format!("{root}/tests/data/{name}-pillow.png"))
                .unwrap()
                .to_rgb8();
            assert!(ours == pillow, "{name}.jpg differs from Pillow's RGB");
        }
    }
}
