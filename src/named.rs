//! Choices the user names (devices, precisions, kernels, presets, image backends) declared one
//! way. The bottom layer: every other module may use it, and it uses none.

/// Declares an enum whose variants are named in kebab case (`Display`, `FromStr`,
/// `&'static str`), listed (`VARIANTS`), and documented by their doc comments (`EnumMessage`),
/// so that the command line parses and lists them (`cli::choice`) and messages name them, all
/// spelled one way. Further derives (`Default`, `Hash`) and attributes go before `enum`.
macro_rules! named_choice {
    ($(#[$attribute:meta])* $visibility:vis enum $name:ident $variants:tt) => {
        #[derive(
            Debug,
            Clone,
            Copy,
            PartialEq,
            Eq,
            strum::Display,
            strum::IntoStaticStr,
            strum::EnumString,
            strum::VariantArray,
            strum::VariantNames,
            strum::EnumMessage,
        )]
        #[strum(serialize_all = "kebab-case")]
        $(#[$attribute])*
        $visibility enum $name $variants
    };
}

pub(crate) use named_choice;
