//! The image processor against transformers' `Qwen2VLImageProcessor` with each of its
//! backends (torchvision, the default, and PIL) on each family's fixture images, with each
//! family's settings (Qwen3-VL's: patches of 16, mean and std 0.5, `size` in pixels).

mod common;

use common::{Expected, family_dir, pixel_values_key, requests_in};
use mmlora::preprocess::{ImageBackend, PreprocessConfig, load_image, preprocess};

#[test]
fn pixel_values_and_grids_match_transformers() {
    for (family, pixels, patch) in [
        ("qwen2-vl", (3136, 7056), 14),
        ("qwen2.5-vl", (3136, 7056), 14),
        ("qwen3-vl", (2048, 12288), 16),
    ] {
        let dir = family_dir(family);
        let expected = Expected::load_from(&dir);
        let config = PreprocessConfig::from_model_dir(&dir).unwrap();
        assert_eq!((config.min_pixels, config.max_pixels), pixels, "{family}");
        assert_eq!(config.patch_size, patch, "{family}");
        for request in requests_in(&dir) {
            let file = request.image.trim_start_matches("images/");
            let image = load_image(&dir.join(&request.image)).unwrap();
            for backend in [ImageBackend::Torchvision, ImageBackend::Pil] {
                let patches = preprocess(&image, &config, backend).unwrap();
                let grid = expected.i64(&format!("{file}.image_grid_thw"));
                assert_eq!(
                    patches.grid_thw.map(|g| g as i64).to_vec(),
                    grid,
                    "{family} {file}: grid"
                );
                let (values, shape) = expected.f32(&pixel_values_key(file, backend));
                let rows = [patches.rows(), config.patch_len()];
                assert_eq!(shape, rows, "{family} {file} {backend}: shape");
                // Exactly equal: the same decode (libjpeg-turbo's C code for JPEG), the
                // backend's fixed-point resize, and its f32 arithmetic in its order.
                let differing = values
                    .iter()
                    .zip(&patches.pixel_values)
                    .filter(|(a, b)| a != b)
                    .count();
                assert_eq!(
                    differing, 0,
                    "{family} {file} {backend}: values differ from transformers'"
                );
            }
        }
    }
}

/// The two backends really differ on these fixtures, so the exact match above tells them
/// apart: where nothing is resized only in the last bits of the floats (the orders of
/// operations differ), on a resized image by one 8-bit level (≥ 1/255/std) or more (`rgba.png`,
/// 90×70 → 84×56 for Qwen2-VL: its height shrinks by more than twice the width's 6 pixels, so
/// Pillow 13 runs the vertical pass first).
#[test]
fn the_backends_differ_where_transformers_does() {
    let dir = family_dir("qwen2-vl");
    let expected = Expected::load_from(&dir);
    for (file, resized) in [
        ("square.png", false),
        ("rgba.png", true),
        ("wide.jpg", true),
    ] {
        let (torchvision, _) = expected.f32(&pixel_values_key(file, ImageBackend::Torchvision));
        let (pil, _) = expected.f32(&pixel_values_key(file, ImageBackend::Pil));
        let worst = torchvision
            .iter()
            .zip(&pil)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        if resized {
            assert!(worst >= 1.0 / 255.0 / 0.28, "{file}: max |Δ| = {worst}");
        } else {
            assert!(worst > 0.0 && worst <= 1e-6, "{file}: max |Δ| = {worst}");
        }
    }
}
