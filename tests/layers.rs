//! The crate's module graph: each top-level module imports only from the layers below it, and no
//! files form a cycle.
//!
//! The graph is read from the source, as a reader would follow it: every `crate::`, `super::`,
//! `self::` and `mmlora::` path outside comments and outside the test module at the bottom of a
//! file, resolved to the file that defines the longest prefix of it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use regex::Regex;

/// The layers, bottom first. A module may use its own files and the modules of lower layers;
/// modules of one layer are independent of each other.
const LAYERS: &[&[&str]] = &[
    &["named", "vfs"],
    &["runtime", "routing", "preprocess", "files"],
    &["ops"],
    &["nn"],
    &["models"],
    &["adapters"],
    &["engine"],
    &["analysis", "bench", "bundled", "fuzzing"],
    &["cli"],
];

/// A source file: its path under `src/` and its module path.
struct Source {
    file: String,
    module: Vec<String>,
    text: String,
}

fn sources() -> Vec<Source> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for entry in walkdir::WalkDir::new(&root) {
        let path = entry.unwrap().into_path();
        if path.extension().is_some_and(|e| e == "rs") {
            let file = path
                .strip_prefix(&root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let mut module: Vec<String> = file
                .trim_end_matches(".rs")
                .split('/')
                .map(str::to_owned)
                .collect();
            if matches!(
                module.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                module.pop();
            }
            let text = std::fs::read_to_string(&path).unwrap();
            found.push(Source { file, module, text });
        }
    }
    found.sort_by(|a, b| a.file.cmp(&b.file));
    found
}

/// `text` without comments and without the `#[cfg(test)] mod … {` block (and what follows it).
fn code(text: &str) -> String {
    let line_comment = Regex::new(r"//[^\n]*").unwrap();
    let block_comment = Regex::new(r"(?s)/\*.*?\*/").unwrap();
    let text = line_comment.replace_all(text, "");
    let text = block_comment.replace_all(&text, "");
    let tests = Regex::new(r"#\[cfg\(test\)\]\s*(pub(\(crate\))?\s+)?mod\s+\w+\s*\{").unwrap();
    match tests.find(&text) {
        Some(m) => text[..m.start()].to_owned(),
        None => text.into_owned(),
    }
}

/// The paths in a `use` tree's body (`a::{b, c::{d, self}}`), each as its parts.
fn use_paths(prefix: &[String], body: &str) -> Vec<Vec<String>> {
    let body = body
        .strip_prefix('{')
        .and_then(|b| b.strip_suffix('}'))
        .unwrap_or(body);
    let (mut items, mut current, mut depth) = (Vec::new(), String::new(), 0);
    for c in body.chars() {
        match c {
            ',' if depth == 0 => items.push(std::mem::take(&mut current)),
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        if c != ',' || depth != 0 {
            current.push(c);
        }
    }
    items.push(current);
    let mut paths = Vec::new();
    for item in items.iter().filter(|i| !i.is_empty()) {
        if let Some((head, rest)) = item.split_once("::{") {
            let mut deeper = prefix.to_vec();
            deeper.extend(head.split("::").map(str::to_owned));
            paths.extend(use_paths(&deeper, &format!("{{{rest}")));
        } else if item.starts_with('{') {
            paths.extend(use_paths(prefix, item));
        } else {
            let mut path = prefix.to_vec();
            let name = item.split(" as ").next().unwrap();
            path.extend(
                name.split("::")
                    .filter(|p| *p != "self" && *p != "*")
                    .map(str::to_owned),
            );
            paths.push(path);
        }
    }
    paths
}

/// Which file uses which.
fn edges(sources: &[Source]) -> BTreeMap<String, BTreeSet<String>> {
    let modules: BTreeMap<&[String], &str> = sources
        .iter()
        .map(|s| (s.module.as_slice(), s.file.as_str()))
        .collect();
    let resolve = |path: &[String]| -> Option<&str> {
        (1..=path.len())
            .rev()
            .find_map(|k| modules.get(&path[..k]).copied())
    };
    let use_tree = Regex::new(r"\buse\s+(crate|super|self|mmlora)::([^;]*);").unwrap();
    let path = Regex::new(r"\b(crate|super|self|mmlora)((?:::\w+)+)").unwrap();
    let spaces = Regex::new(r"\s+").unwrap();
    let punctuation_spaces = Regex::new(r" ?([:{},]) ?").unwrap();
    let mut edges = BTreeMap::new();
    for source in sources {
        let in_binary =
            source.file == "main.rs" || source.module.first().is_some_and(|m| m == "cli");
        let base = |keyword: &str| -> Vec<String> {
            match keyword {
                "crate" if in_binary => vec!["cli".to_owned()],
                "crate" | "mmlora" => Vec::new(),
                "self" => source.module.clone(),
                _ => source.module[..source.module.len().saturating_sub(1)].to_vec(),
            }
        };
        let code = code(&source.text);
        let mut targets = Vec::new();
        for m in use_tree.captures_iter(&code) {
            let body = spaces.replace_all(&m[2], " ");
            let body = punctuation_spaces.replace_all(&body, "$1");
            targets.extend(use_paths(&base(&m[1]), body.trim()));
        }
        for m in path.captures_iter(&code) {
            let mut target = base(&m[1]);
            target.extend(
                m[2].split("::")
                    .filter(|p| !p.is_empty())
                    .map(str::to_owned),
            );
            targets.push(target);
        }
        let used: BTreeSet<String> = targets
            .iter()
            .filter_map(|t| resolve(t))
            .filter(|f| *f != source.file)
            .map(str::to_owned)
            .collect();
        edges.insert(source.file.clone(), used);
    }
    edges
}

/// The top-level module a file belongs to (`cli` for the binary's root).
fn top(file: &str) -> &str {
    match file.split_once('/') {
        Some((top, _)) => top,
        None if file == "main.rs" => "cli",
        None => file.trim_end_matches(".rs"),
    }
}

fn layer(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

#[test]
fn modules_import_only_from_lower_layers() {
    let sources = sources();
    let mut unknown = BTreeSet::new();
    let mut upward = Vec::new();
    for (file, used) in edges(&sources) {
        if file == "lib.rs" {
            continue;
        }
        let Some(own) = layer(top(&file)) else {
            unknown.insert(top(&file).to_owned());
            continue;
        };
        for target in used {
            let other = layer(top(&target));
            let allowed = top(&target) == top(&file) || other.is_some_and(|other| other < own);
            if !allowed {
                upward.push(format!("{file} uses {target}"));
            }
        }
    }
    assert!(unknown.is_empty(), "modules in no layer: {unknown:?}");
    assert!(
        upward.is_empty(),
        "imports that do not go down a layer:\n{}",
        upward.join("\n")
    );
}

#[test]
fn no_files_form_a_cycle() {
    let edges = edges(&sources());
    // Tarjan's strongly connected components.
    struct Walk<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        cycles: Vec<Vec<&'a str>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, file: &'a str) {
            let at = self.index.len();
            self.index.insert(file, at);
            self.low.insert(file, at);
            self.stack.push(file);
            for next in self.edges.get(file).into_iter().flatten() {
                if !self.index.contains_key(next.as_str()) {
                    self.visit(next);
                    let low = self.low[file].min(self.low[next.as_str()]);
                    self.low.insert(file, low);
                } else if self.stack.contains(&next.as_str()) {
                    let low = self.low[file].min(self.index[next.as_str()]);
                    self.low.insert(file, low);
                }
            }
            if self.low[file] == self.index[file] {
                let from = self.stack.iter().rposition(|f| *f == file).unwrap();
                let component = self.stack.split_off(from);
                if component.len() > 1 {
                    self.cycles.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        edges: &edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        cycles: Vec::new(),
    };
    for file in edges.keys() {
        if !walk.index.contains_key(file.as_str()) {
            walk.visit(file);
        }
    }
    assert!(
        walk.cycles.is_empty(),
        "files in a cycle: {:?}",
        walk.cycles
    );
}

/// The reading above finds what it must: a known upward import and a known cycle, planted in a
/// copy of two files, are reported.
#[test]
fn the_graph_sees_uses_in_paths_and_use_trees() {
    let planted = |file: &str, module: &[&str], text: &str| Source {
        file: file.to_owned(),
        module: module.iter().map(|m| m.to_string()).collect(),
        text: text.to_owned(),
    };
    let sources = [
        planted(
            "runtime/a.rs",
            &["runtime", "a"],
            "use crate::{ops::b::{self, X}};\n",
        ),
        planted(
            "ops/b.rs",
            &["ops", "b"],
            "fn f() { crate::runtime::a::g(); }\n// crate::engine\n",
        ),
        planted(
            "engine.rs",
            &["engine"],
            "#[cfg(test)]\nmod tests { use crate::runtime::a; }\n",
        ),
    ];
    let edges = edges(&sources);
    assert_eq!(
        edges["runtime/a.rs"],
        BTreeSet::from(["ops/b.rs".to_owned()])
    );
    assert_eq!(
        edges["ops/b.rs"],
        BTreeSet::from(["runtime/a.rs".to_owned()])
    );
    assert!(
        edges["engine.rs"].is_empty(),
        "test modules and comments are left out"
    );
}
