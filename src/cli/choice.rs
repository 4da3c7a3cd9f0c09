//! Command-line values for the library's named choices (device, precision, model preset): each
//! enum's names as strum spells them, with its doc comments as their help, so that the library
//! needs no clap.

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use strum::{EnumMessage, VariantArray};

/// A parser of `T`'s names into `T`, listing them (with their docs) in `--help`.
pub fn of<T>() -> impl TypedValueParser<Value = T>
where
    T: VariantArray + EnumMessage + Into<&'static str> + Copy + Send + Sync + 'static,
{
    let values = T::VARIANTS.iter().map(|&variant| {
        let value = PossibleValue::new(variant.into());
        match variant.get_documentation() {
            // One paragraph: strum keeps the doc comment's line breaks.
            Some(doc) => value.help(doc.split_whitespace().collect::<Vec<_>>().join(" ")),
            None => value,
        }
    });
    PossibleValuesParser::new(values).map(|name| {
        *T::VARIANTS
            .iter()
            .find(|&&variant| variant.into() == name)
            .expect("clap passes only the names it lists")
    })
}
