//! Batch files: the adapters to load and the requests to encode, as `mmlora encode --batch`
//! reads them.
//!
//! ```json
//! {"adapters": {"NAME": "DIR"}, "requests": [{"id": "a", "image": "x.png", "adapter": "NAME"}]}
//! ```
//!
//! Paths are relative to the file's folder. A batch is checked whole before anything runs: at
//! least one request, unique ids, and every adapter a request names listed under `adapters`.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{ImageSource, Request};

/// A parsed batch file.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Adapters to load: name and folder, sorted by name.
    pub adapters: Vec<(String, PathBuf)>,
    /// The requests, in file order.
    pub requests: Vec<Request>,
}

/// Why a batch file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a valid batch.
    #[error("{path}: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchFile {
    #[serde(default, deserialize_with = "names_once")]
    adapters: BTreeMap<String, PathBuf>,
    requests: Vec<BatchRequest>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchRequest {
    id: String,
    image: PathBuf,
    #[serde(default)]
    adapter: Option<String>,
}

impl Batch {
    /// Reads and checks the batch file at `path`.
    pub fn read(path: &Path) -> Result<Self, BatchError> {
        let text = crate::vfs::read_to_string(path).map_err(|source| BatchError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses and checks `text`, the contents of the batch file at `path`.
    pub fn parse(text: &str, path: &Path) -> Result<Self, BatchError> {
        let invalid = |reason: String| BatchError::Invalid {
            path: path.to_owned(),
            reason,
        };
        let file: BatchFile = serde_json::from_str(text).map_err(|e| invalid(e.to_string()))?;
        if file.requests.is_empty() {
            return Err(invalid("the batch has no requests".to_owned()));
        }
        if file.adapters.contains_key("") {
            return Err(invalid("an adapter's name is empty".to_owned()));
        }
        let mut ids = HashSet::new();
        for request in &file.requests {
            if request.id.is_empty() {
                return Err(invalid("a request's id is empty".to_owned()));
            }
            if !ids.insert(request.id.as_str()) {
                return Err(invalid(format!(
                    "request id `{}` appears more than once",
                    request.id
                )));
            }
            if let Some(adapter) = &request.adapter
                && !file.adapters.contains_key(adapter)
            {
                return Err(invalid(format!(
                    "request `{}` names adapter `{adapter}`, which `adapters` does not list",
                    request.id
                )));
            }
        }
        let base = path.parent().unwrap_or(Path::new("."));
        Ok(Self {
            adapters: file
                .adapters
                .into_iter()
                .map(|(name, dir)| (name, base.join(dir)))
                .collect(),
            requests: file
                .requests
                .into_iter()
                .map(|r| Request {
                    id: r.id,
                    image: ImageSource::File(base.join(r.image)),
                    adapter: r.adapter,
                })
                .collect(),
        })
    }
}

/// A JSON object of adapter names and folders, refusing a name given twice (serde would keep
/// the last folder silently).
fn names_once<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<BTreeMap<String, PathBuf>, D::Error> {
    struct Names;
    impl<'de> serde::de::Visitor<'de> for Names {
        type Value = BTreeMap<String, PathBuf>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object of adapter names and folders")
        }

        fn visit_map<M: serde::de::MapAccess<'de>>(
            self,
            mut map: M,
        ) -> Result<Self::Value, M::Error> {
            let mut names = BTreeMap::new();
            while let Some((name, dir)) = map.next_entry::<String, PathBuf>()? {
                if names.contains_key(&name) {
                    return Err(serde::de::Error::custom(format!(
                        "adapter `{name}` is listed twice"
                    )));
                }
                names.insert(name, dir);
            }
            Ok(names)
        }
    }
    deserializer.deserialize_map(Names)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Batch, BatchError> {
        Batch::parse(text, Path::new("/jobs/batch.json"))
    }

    #[test]
    fn paths_are_relative_to_the_file_and_absolute_paths_stay() {
        let batch = parse(
            r#"{"adapters": {"a": "adapters/a", "b": "/abs/b"},
                "requests": [{"id": "1", "image": "x.png", "adapter": "a"}, {"id": "2", "image": "/y.jpg"}]}"#,
        )
        .unwrap();
        assert_eq!(
            batch.adapters,
            [
                ("a".to_owned(), PathBuf::from("/jobs/adapters/a")),
                ("b".to_owned(), PathBuf::from("/abs/b"))
            ]
        );
        assert!(
            matches!(&batch.requests[0].image, ImageSource::File(p) if p == Path::new("/jobs/x.png"))
        );
        assert!(
            matches!(&batch.requests[1].image, ImageSource::File(p) if p == Path::new("/y.jpg"))
        );
        assert_eq!(batch.requests[0].adapter.as_deref(), Some("a"));
        assert_eq!(batch.requests[1].adapter, None);
    }

    #[test]
    fn bad_batches_name_the_file_and_the_problem() {
        let cases = [
            ("{", "EOF"),
            (r#"{"requests": []}"#, "no requests"),
            (
                r#"{"requests": [{"id": "1", "image": "x"}, {"id": "1", "image": "y"}]}"#,
                "`1` appears more than once",
            ),
            (
                r#"{"requests": [{"id": "1", "image": "x", "adapter": "z"}]}"#,
                "adapter `z`",
            ),
            (r#"{"requests": [{"id": "1"}]}"#, "missing field `image`"),
            (
                r#"{"requests": [{"id": "1", "image": "x", "adaptor": "z"}]}"#,
                "unknown field `adaptor`",
            ),
            (
                r#"{"adapters": {"a": "one", "a": "two"}, "requests": [{"id": "1", "image": "x"}]}"#,
                "adapter `a` is listed twice",
            ),
            (
                r#"{"adapters": {"": "one"}, "requests": [{"id": "1", "image": "x"}]}"#,
                "adapter's name is empty",
            ),
            (r#"{"requests": [{"id": "", "image": "x"}]}"#, "id is empty"),
        ];
        for (text, expected) in cases {
            let error = parse(text).unwrap_err().to_string();
            assert!(
                error.starts_with("/jobs/batch.json: ") && error.contains(expected),
                "{text}: {error}"
            );
        }
    }
}
