//! The ops a model is written in, one module per op. Each has its entry function, its backend
//! extension trait (implemented for Flex and for Burn's wgpu backend), the composed reference
//! (Burn's own tensor ops) beside its fast paths, and tests that they agree.
//!
//! [`lora`] builds on [`linear`] (its fused form runs in the linear kernels' store); the others
//! stand alone.

pub(crate) mod activation;
pub mod attention;
pub(crate) mod hardware;
pub mod kernels;
pub mod linear;
pub mod lora;
pub(crate) mod norm;
pub(crate) mod rotary;
#[cfg(test)]
pub(crate) mod testing;

#[cfg(test)]
mod tests {
    /// `shaders/` holds one folder per op that has shaders, and each of those ops' tests checks
    /// every file in its folder: a file anywhere else would go unchecked.
    #[test]
    fn shaders_are_grouped_by_op() {
        let mut entries: Vec<String> =
            std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/shaders"))
                .unwrap()
                .map(|entry| {
                    let entry = entry.unwrap();
                    assert!(
                        entry.file_type().unwrap().is_dir(),
                        "{:?} is not an op's folder",
                        entry.path()
                    );
                    entry.file_name().to_string_lossy().into_owned()
                })
                .collect();
        entries.sort();
        assert_eq!(entries, ["attention", "linear", "lora", "norm", "rotary"]);
    }
}
