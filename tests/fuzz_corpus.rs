//! Replays the committed fuzz corpora (`fuzz/seeds/TARGET/`: the seeds plus what the fuzzers
//! found, minimised) through the same checks the `cargo fuzz` targets run, on stable Rust: the
//! bounded fuzz run in CI. Longer runs: `fuzz/README.md`.

use std::path::PathBuf;

fn replay(target: &str, check: fn(&[u8])) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target);
    let mut inputs = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        if std::panic::catch_unwind(|| check(&bytes)).is_err() {
            panic!("{} breaks the {target} check", path.display());
        }
        inputs += 1;
    }
    assert!(inputs > 0, "no corpus in {}", dir.display());
    println!("{target}: {inputs} inputs");
}

#[test]
fn adapter_config_corpus() {
    replay("adapter_config", mmlora::fuzzing::adapter_config);
}

#[test]
fn adapter_safetensors_corpus() {
    replay("adapter_safetensors", mmlora::fuzzing::adapter_safetensors);
}

#[test]
fn batch_json_corpus() {
    replay("batch_json", mmlora::fuzzing::batch_json);
}

#[test]
fn mapping_corpus() {
    replay("mapping", mmlora::fuzzing::mapping);
}
