//! The image processor against transformers' `Qwen2VLImageProcessorPil` on each family's
//! fixture images, with each family's settings (Qwen3-VL's: patches of 16, mean and std 0.5,
//! `size` in pixels).

mod common;

use common::{Expected, family_dir, requests_in};
use mmlora::preprocess::{PreprocessConfig, load_image, preprocess};

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
            let patches = preprocess(&image, &config).unwrap();
            let grid = expected.i64(&format!("{file}.image_grid_thw"));
            assert_eq!(
                patches.grid_thw.map(|g| g as i64).to_vec(),
                grid,
                "{family} {file}: grid"
            );
            let (values, shape) = expected.f32(&format!("{file}.pixel_values"));
            let rows = [patches.rows(), config.patch_len()];
            assert_eq!(shape, rows, "{family} {file}: shape");
            let worst = values
                .iter()
                .zip(&patches.pixel_values)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            // The same decode (libjpeg-turbo's C code for JPEG), Pillow's fixed-point bicubic,
            // the same f64→f32 rescale and f32 normalisation as transformers', so 1e-6
            // absolute; one 8-bit level of decode or resize difference (≥ 0.015) stands far
            // above it.
            assert!(worst <= 1e-6, "{family} {file}: max |Δ| = {worst}");
        }
    }
}
