//! The image processor against transformers' `Qwen2VLImageProcessorPil` on the fixture images.

mod common;

use common::{Expected, fixture_dir, requests};
use mmlora::preprocess::{PreprocessConfig, load_image, preprocess};

#[test]
fn pixel_values_and_grids_match_transformers() {
    let expected = Expected::load();
    let config = PreprocessConfig::from_model_dir(&fixture_dir()).unwrap();
    assert_eq!((config.min_pixels, config.max_pixels), (3136, 7056));
    for request in requests() {
        let file = request.image.trim_start_matches("images/");
        let image = load_image(&fixture_dir().join(&request.image)).unwrap();
        let patches = preprocess(&image, &config).unwrap();
        let grid = expected.i64(&format!("{file}.image_grid_thw"));
        assert_eq!(
            patches.grid_thw.map(|g| g as i64).to_vec(),
            grid,
            "{file}: grid"
        );
        let (values, shape) = expected.f32(&format!("{file}.pixel_values"));
        assert_eq!(shape, [patches.rows(), config.patch_len()], "{file}: shape");
        let worst = values
            .iter()
            .zip(&patches.pixel_values)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        // The same decode (libjpeg-turbo's C code for JPEG), Pillow's fixed-point bicubic, the
        // same f64→f32 rescale and f32 normalisation as transformers', so 1e-6 absolute; one
        // 8-bit level of decode or resize difference (≥ 0.015) stands far above it.
        assert!(worst <= 1e-6, "{file}: max |Δ| = {worst}");
    }
}
