//! The `mmlora` binary, spawned as a user would run it: every subcommand, the fixtures
//! reproduced through `encode` on both devices, and every kind of bad input refused cleanly.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{Expected, errors, family_dir, fixture_dir, pixel_values_key, requests, requests_in};
use mmlora::preprocess::ImageBackend;
use safetensors::SafeTensors;

fn mmlora(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mmlora"))
        .args(args)
        .output()
        .expect("the mmlora binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn fixture(path: &str) -> String {
    fixture_dir().join(path).display().to_string()
}

fn assert_success(out: &Output) -> String {
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    stdout
}

/// A tensor of a safetensors file as f32 values (f32 or i64 on disk).
fn read_tensor(bytes: &[u8], name: &str) -> Vec<f64> {
    let file = SafeTensors::deserialize(bytes).unwrap();
    let view = file.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    match view.dtype() {
        safetensors::Dtype::F32 => view
            .data()
            .chunks_exact(4)
            .map(|b| f64::from(f32::from_le_bytes(b.try_into().unwrap())))
            .collect(),
        safetensors::Dtype::I64 => view
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f64)
            .collect(),
        other => panic!("{name}: unexpected dtype {other:?}"),
    }
}

/// Checks `file`'s `{id}.tower`, `{id}.embeds` and, where the reference has them,
/// `{id}.deepstack` against `expected`'s outputs of `fixture_id`.
fn assert_output_matches(
    file: &Path,
    expected: &Expected,
    id: &str,
    fixture_id: &str,
    rel_tol: f64,
) {
    let written = std::fs::read(file).unwrap();
    let names: Vec<String> = SafeTensors::deserialize(&written)
        .unwrap()
        .names()
        .into_iter()
        .map(str::to_owned)
        .collect();
    for part in ["tower", "embeds", "deepstack"] {
        let key = format!("{fixture_id}.{part}");
        let has = names.contains(&format!("{id}.{part}"));
        assert_eq!(has, expected.has(&key), "{id}.{part} written");
        if !has {
            continue;
        }
        let actual = read_tensor(&written, &format!("{id}.{part}"));
        let (want, _) = expected.f32(&key);
        let (rel, worst) = errors(&actual, &want);
        assert!(
            rel <= rel_tol && worst <= 1e-4,
            "{id}.{part}: rel {rel:e}, max {worst:e}"
        );
    }
}

/// `encode --batch` over the fixture batch of `family` on `device`, checked against
/// transformers + PEFT.
fn batch_reproduces_fixtures(family: &str, device: &str, extra: &[&str], rel_tol: f64) {
    let dir = tempfile::TempDir::new().unwrap();
    let out = dir.path().join("out.safetensors");
    let fixtures = family_dir(family);
    let batch = fixtures.join("batch.json").display().to_string();
    let model = fixtures.display().to_string();
    let mut args = vec![
        "encode",
        "--model",
        &model,
        "--batch",
        &batch,
        "--with-tower",
        "--device",
        device,
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let stdout = assert_success(&mmlora(&args));
    let expected = Expected::load_from(&fixtures);
    for request in requests_in(&fixtures) {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&format!("{}:", request.id))),
            "no summary line for {} in {stdout}",
            request.id
        );
        assert_output_matches(&out, &expected, &request.id, &request.id, rel_tol);
    }
}

/// The model families with fixtures, as `assets/tiny-<family>/` names them.
const FAMILIES: [&str; 3] = ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"];

/// `encode` with no arguments, from a copy of the binary in a folder of its own, run from
/// there: the bundled model, adapters, images and batch are inside the binary, not found
/// through the checkout it was built in.
#[test]
fn encode_without_arguments_runs_the_bundled_batch() {
    let elsewhere = tempfile::TempDir::new().unwrap();
    let binary = elsewhere.path().join("mmlora");
    std::fs::copy(env!("CARGO_BIN_EXE_mmlora"), &binary).unwrap();
    let out = Command::new(&binary)
        .arg("encode")
        .current_dir(elsewhere.path())
        .output()
        .expect("the copied binary runs");
    let stdout = assert_success(&out);
    let stderr = text(&out.stderr);
    assert!(stderr.starts_with("device: "), "{stderr}");
    assert!(
        stderr.contains("model: bundled tiny-qwen2-vl loaded"),
        "{stderr}"
    );
    assert_eq!(stdout.lines().count(), requests().len(), "{stdout}");
    for request in requests() {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{}:", request.id)))
            .unwrap_or_else(|| panic!("no line for {} in {stdout}", request.id));
        let adapter = request.adapter.as_deref().unwrap_or("none");
        assert!(line.contains(&format!("adapter {adapter},")), "{line}");
        assert!(
            line.contains("tower tokens") && line.contains(" ms"),
            "{line}"
        );
    }
}

#[test]
fn encode_batch_reproduces_the_fixtures_on_cpu() {
    for family in FAMILIES {
        // Tolerance: rel. Frobenius 1e-5, max abs 1e-4 (the model issue's CPU bounds).
        batch_reproduces_fixtures(family, "cpu", &[], 1e-5);
    }
    // One slot for four adapters: four steps, the same numbers.
    batch_reproduces_fixtures("qwen2-vl", "cpu", &["--max-loras", "1"], 1e-5);
}

#[test]
fn encode_batch_reproduces_the_fixtures_on_gpu() {
    if mmlora::runtime::device::gpu_for_tests().is_none() {
        return;
    }
    for family in FAMILIES {
        // Tolerance: rel. Frobenius 1e-4 (GPU summation order), max abs 1e-4.
        batch_reproduces_fixtures(family, "gpu", &[], 1e-4);
    }
}

#[test]
fn encode_images_with_one_adapter() {
    let dir = tempfile::TempDir::new().unwrap();
    let out = dir.path().join("out.safetensors");
    let square = fixture("images/square.png");
    let stdout = assert_success(&mmlora(&[
        "encode",
        &square,
        &square,
        "--adapter",
        &fixture("adapters/all-r4"),
        "--device",
        "cpu",
        "--with-tower",
        "--out",
        out.to_str().unwrap(),
    ]));
    assert!(stdout.contains("square.png#2:"), "{stdout}");
    // request0 of the fixtures is square.png with all-r4.
    for id in ["square.png", "square.png#2"] {
        assert_output_matches(&out, &Expected::load(), id, "request0", 1e-5);
    }
}

#[test]
fn preprocess_writes_what_the_engine_feeds() {
    let dir = tempfile::TempDir::new().unwrap();
    let expected = Expected::load();
    // No flag is transformers 5's default backend, torchvision.
    for (flag, backend) in [
        (None, ImageBackend::Torchvision),
        (Some("pil"), ImageBackend::Pil),
    ] {
        for file in ["wide.jpg", "progressive.jpg", "rgba.png"] {
            let out = dir.path().join(format!("{file}.safetensors"));
            let image = fixture(&format!("images/{file}"));
            let mut args = vec!["preprocess", &image, "--out", out.to_str().unwrap()];
            args.extend(
                flag.iter()
                    .flat_map(|&backend| ["--image-backend", backend]),
            );
            assert_success(&mmlora(&args));
            let written = std::fs::read(&out).unwrap();
            let grid = read_tensor(&written, "image_grid_thw");
            let want_grid = expected.i64(&format!("{file}.image_grid_thw"));
            assert_eq!(
                grid,
                want_grid.iter().map(|&g| g as f64).collect::<Vec<_>>()
            );
            let pixels = read_tensor(&written, "pixel_values");
            let (want, _) = expected.f32(&pixel_values_key(file, backend));
            // Exactly, as in tests/preprocess_fixtures.rs.
            assert!(
                pixels
                    .iter()
                    .copied()
                    .eq(want.iter().map(|&e| f64::from(e))),
                "{file} ({flag:?}): pixel values differ from transformers'"
            );
        }
    }
}

/// A named pipe and standard output piped to another process take the whole file, written in
/// place. Before, checking a named pipe against the inputs opened it for reading and waited for
/// a writer forever, and `/dev/stdout` was followed to a path that does not exist.
#[cfg(unix)]
#[test]
fn outputs_to_pipes_are_written_whole() {
    let dir = tempfile::TempDir::new().unwrap();
    let square = fixture("images/square.png");
    let file = dir.path().join("file.safetensors");
    assert_success(&mmlora(&[
        "preprocess",
        &square,
        "--out",
        file.to_str().unwrap(),
    ]));
    let expected = std::fs::read(file).unwrap();

    let fifo = dir.path().join("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read(fifo).unwrap())
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_mmlora"))
        .args(["preprocess", &square, "--out", fifo.to_str().unwrap()])
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > std::time::Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("mmlora still writing the named pipe after 60 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success());
    assert_eq!(reader.join().unwrap(), expected);

    let piped = mmlora(&["preprocess", &square, "--out", "/dev/stdout"]);
    assert!(piped.status.success(), "{}", text(&piped.stderr));
    assert_eq!(piped.stdout, expected);
}

#[test]
fn devices_lists_what_wgpu_sees_and_what_mmlora_uses() {
    let stdout = assert_success(&mmlora(&["devices"]));
    assert!(
        stdout.contains("--device auto (the default) uses: "),
        "{stdout}"
    );
    // wgpu reads a list of APIs from WGPU_BACKEND, the runtime one API: `devices` refuses the
    // list as every command does, instead of listing adapters as if it held.
    refused_under_backend(&["devices"], "vulkan,gl");
}

/// `args` with `WGPU_BACKEND=backend` exit 1 naming the value.
fn refused_under_backend(args: &[&str], backend: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_mmlora"))
        .args(args)
        .env("WGPU_BACKEND", backend)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains(backend), "{}", text(&out.stderr));
}

/// Kernels are pinned by one override, `MMLORA_KERNELS` or `bench --kernels`, said on stderr;
/// a pin that cannot be read or run is refused by name before any work, and `encode` has no
/// kernel flags.
#[test]
fn kernel_pins_are_one_override_refused_by_name() {
    let encode = |pins: &str, args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_mmlora"))
            .args(["encode", "--device", "cpu"])
            .args(args)
            .env("MMLORA_KERNELS", pins)
            .output()
            .unwrap()
    };
    let out = encode("attention=fused", &[]);
    assert_success(&out);
    assert!(
        text(&out.stderr).contains("kernels: attention=fused (MMLORA_KERNELS)"),
        "{}",
        text(&out.stderr)
    );
    for (pins, says) in [
        (
            "shrink=fast",
            "MMLORA_KERNELS: kernel pin shrink=fast: no such kernel",
        ),
        ("norm=fused", "no such op"),
        ("linear=tiled", "the tiled linear kernel needs a GPU device"),
    ] {
        let out = encode(pins, &[]);
        assert_eq!(out.status.code(), Some(1), "{pins}");
        assert!(
            text(&out.stderr).contains(says),
            "{pins}: {}",
            text(&out.stderr)
        );
        assert!(text(&out.stdout).is_empty(), "{pins} encoded");
    }
    let out = encode("", &["--linear-kernel", "tiled"]);
    assert_eq!(out.status.code(), Some(2), "encode takes no kernel flags");

    let bench = [
        "bench", "--device", "cpu", "--preset", "tiny", "--images", "1",
    ];
    let out = mmlora(&[&bench[..], &["--adapters", "1", "--kernels", "linear=wgsl"]].concat());
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("kernels: linear=wgsl"), "{stderr}");
    assert!(
        stderr.contains("the wgsl linear kernel needs a GPU device"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("preparing"),
        "refused after work began: {stderr}"
    );
    let out = mmlora(&[&bench[..], &["--kernels", "linear"]].concat());
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("is not OP=KERNEL"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn adapters_inspect_reports_the_adapter_and_its_compatibility() {
    let stdout = assert_success(&mmlora(&[
        "adapters",
        "inspect",
        &fixture("adapters/all-r4"),
    ]));
    for want in ["rank 4, alpha 8, scale 2", "qkv", "merger.mlp.2", ": yes"] {
        assert!(stdout.contains(want), "{want:?} not in {stdout}");
    }
    let stdout = assert_success(&mmlora(&[
        "adapters",
        "inspect",
        &fixture("adapters/rslora-r8"),
    ]));
    assert!(stdout.contains("rsLoRA"), "{stdout}");

    // A model of another width: the adapter's shapes do not fit.
    let model = tempfile::TempDir::new().unwrap();
    let config = std::fs::read_to_string(fixture_dir().join("config.json"))
        .unwrap()
        .replace("\"embed_dim\": 32", "\"embed_dim\": 64");
    std::fs::write(model.path().join("config.json"), config).unwrap();
    let out = mmlora(&[
        "adapters",
        "inspect",
        &fixture("adapters/all-r4"),
        "--model",
        model.path().to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stdout).contains(": no — "),
        "{}",
        text(&out.stdout)
    );
    assert!(
        text(&out.stderr).contains("not compatible"),
        "{}",
        text(&out.stderr)
    );
}

/// An output that is one of the run's inputs, by whatever path, is refused before anything
/// runs, and the input is left as it was.
#[cfg(unix)]
#[test]
fn an_output_that_would_replace_an_input_is_refused() {
    let dir = tempfile::TempDir::new().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for entry in std::fs::read_dir(fixture_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, model.join(path.file_name().unwrap())).unwrap();
        }
    }
    let image = dir.path().join("square.png");
    std::fs::copy(fixture_dir().join("images/square.png"), &image).unwrap();
    let link = dir.path().join("link.png");
    std::os::unix::fs::symlink(&image, &link).unwrap();
    let config = model.join("config.json");
    let shard = model.join("model-00001-of-00002.safetensors");
    let [image_s, model_s] = [&image, &model].map(|p| p.display().to_string());
    let encode = [
        "encode", "--device", "cpu", "--model", &model_s, &image_s, "--out",
    ];
    let preprocess = ["preprocess", &image_s, "--model", &model_s, "--out"];
    for (command, out) in [
        (&encode[..], &image),
        (&encode[..], &link),
        (&encode[..], &shard),
        (&preprocess[..], &image),
        (&preprocess[..], &config),
    ] {
        let before = std::fs::read(out).unwrap();
        let args = [command, &[out.to_str().unwrap()]].concat();
        let result = mmlora(&args);
        assert_eq!(result.status.code(), Some(1), "{args:?}");
        let stderr = text(&result.stderr);
        assert!(
            stderr.contains("an input of this run"),
            "{args:?}: {stderr}"
        );
        assert_eq!(std::fs::read(out).unwrap(), before, "{args:?} changed it");
    }
    // A new file beside the inputs is fine.
    let fresh = model.join("out.safetensors");
    assert_success(&mmlora(&[&encode[..], &[fresh.to_str().unwrap()]].concat()));
}

/// Bad arguments; bad files are the corpus in `tests/corpus.rs`.
#[test]
fn bad_arguments_fail_with_a_readable_error_and_leave_no_output() {
    let dir = tempfile::TempDir::new().unwrap();
    let at = |name: &str| dir.path().join(name);
    let square = fixture("images/square.png");
    let all_r4 = fixture("adapters/all-r4");
    let not_an_image = at("not-an-image.png");
    std::fs::write(&not_an_image, b"hello, world").unwrap();
    let not_an_image = not_an_image.display().to_string();

    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                square.clone(),
                "--adapter".into(),
                all_r4.clone(),
                "--max-rank".into(),
                "2".into(),
            ],
            "max_rank",
        ),
        (vec!["--device".into(), "tpu".into()], "tpu"),
        (vec!["--adapter".into(), all_r4.clone()], "IMAGES"),
        (vec!["--model".into(), fixture("")], "nothing to encode"),
    ];
    for (i, (args, mention)) in cases.into_iter().enumerate() {
        let out_file = at(&format!("out-{i}.safetensors"));
        let mut full = vec!["encode".to_owned(), "--device".into(), "cpu".into()];
        if args[0] == "--device" {
            full.truncate(1);
        }
        full.extend(args);
        full.extend(["--out".to_owned(), out_file.display().to_string()]);
        let full: Vec<&str> = full.iter().map(String::as_str).collect();
        let out = mmlora(&full);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{full:?} succeeded");
        assert!(!stderr.contains("panicked"), "{full:?} panicked: {stderr}");
        assert!(
            stderr.contains(mention),
            "{full:?}: {mention:?} not in {stderr}"
        );
        assert!(!out_file.exists(), "{full:?} left {}", out_file.display());
    }

    // The output's folder must exist; nothing is computed when it does not.
    let out = mmlora(&[
        "encode",
        &square,
        "--out",
        "/nonexistent-folder/out.safetensors",
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("does not exist"),
        "{}",
        text(&out.stderr)
    );

    for args in [
        &["frobnicate"][..],
        &["preprocess", &square],
        &["adapters", "inspect"],
    ] {
        let out = mmlora(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            !text(&out.stderr).trim().is_empty(),
            "{args:?} said nothing"
        );
    }
    let preprocessed = at("p.safetensors");
    let out = mmlora(&[
        "preprocess",
        &not_an_image,
        "--out",
        preprocessed.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("not-an-image.png"),
        "{}",
        text(&out.stderr)
    );
    assert!(!preprocessed.exists());

    // A model folder that is not there is an error, not the processor's defaults.
    let out = mmlora(&[
        "preprocess",
        &square,
        "--model",
        "/nonexistent-model",
        "--out",
        preprocessed.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("/nonexistent-model/preprocessor_config.json"),
        "{}",
        text(&out.stderr)
    );
    assert!(!preprocessed.exists());
}

#[test]
fn bench_prints_one_json_object_per_configuration() {
    let dir = tempfile::TempDir::new().unwrap();
    let plot = dir.path().join("throughput.png");
    let stdout = assert_success(&mmlora(&[
        "bench",
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--images",
        "2",
        "--side",
        "56",
        "--adapters",
        "1,2",
        "--ranks",
        "4",
        "--repeats",
        "1",
        "--op-rows",
        "64",
        "--op-mix",
        "rows,runs",
        "--json",
        "--plot",
        plot.to_str().unwrap(),
    ]));
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    let (ops, records): (Vec<_>, Vec<_>) = lines.into_iter().partition(|l| l["kind"] == "op");
    let mixes: Vec<_> = ops.iter().map(|op| op["op_mix"].as_str()).collect();
    assert_eq!(mixes, [Some("rows"), Some("runs")], "{ops:?}");
    for field in [
        "rows",
        "rank",
        "adapters",
        "base_ms",
        "lora_ms",
        "naive_ms",
        "lora_overhead",
        "narrow_lora_ms",
        "narrow_lora_overhead",
        "back_to_back_calls",
        "base_back_to_back_ms",
        "lora_back_to_back_ms",
        "narrow_lora_back_to_back_ms",
        "lora_back_to_back_overhead",
        "narrow_lora_back_to_back_overhead",
        "fused",
        "fused_ms",
        "fused_overhead",
        "fused_back_to_back_ms",
        "fused_back_to_back_overhead",
    ] {
        for op in &ops {
            assert!(!op[field].is_null(), "{field} missing in {op}");
        }
    }
    for op in &ops {
        assert_eq!(
            (op["rows"].as_u64(), op["adapters"].as_u64()),
            (Some(64), Some(2))
        );
    }
    let plot = image::open(&plot).unwrap();
    assert!(plot.width() >= 800 && plot.height() >= 500);
    let configurations: Vec<(u64, u64)> = records
        .iter()
        .map(|r| (r["adapters"].as_u64().unwrap(), r["rank"].as_u64().unwrap()))
        .collect();
    assert_eq!(configurations, [(0, 0), (1, 4), (2, 4)]);
    for record in &records {
        for field in [
            "device",
            "adapter_name",
            "preset",
            "images",
            "side",
            "adapters",
            "rank",
            "steps",
            "median_ms",
            "img_per_s",
            "ratio_vs_base",
            "attention_kernel",
        ] {
            assert!(!record[field].is_null(), "{field} missing in {record}");
        }
        let rounds = record["round_ms"].as_array().unwrap();
        assert_eq!(rounds.len(), 1, "one round: {record}");
        assert!(rounds[0].as_f64().unwrap() > 0.0, "{record}");
        assert_eq!([&record["kind"], &record["device"]], ["throughput", "cpu"]);
    }
    let out = mmlora(&["bench", "--preset", "tiny", "--adapters", "0"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("--adapters 0 is outside 1..="),
        "{}",
        text(&out.stderr)
    );
    // More adapters than images cannot all be in the batch; a plot is a PNG.
    let tiny = [
        "bench", "--preset", "tiny", "--device", "cpu", "--images", "2",
    ];
    for (args, says) in [
        (
            &["--adapters", "1,3"][..],
            "3 distinct adapters cannot be mixed over 2 images",
        ),
        (&["--plot", "throughput.jpg"][..], "name the file *.png"),
    ] {
        let out = mmlora(&[&tiny[..], args].concat());
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(text(&out.stderr).contains(says), "{}", text(&out.stderr));
    }
}

#[test]
fn bench_stages_prints_each_configurations_profile() {
    let args = [
        "bench",
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--images",
        "2",
        "--side",
        "56",
        "--adapters",
        "1,2",
        "--ranks",
        "4",
        "--repeats",
        "1",
        "--stages",
    ];
    let stdout = assert_success(&mmlora(&[&args[..], &["--json"]].concat()));
    let profiles: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    let configurations: Vec<(u64, u64)> = profiles
        .iter()
        .map(|p| (p["adapters"].as_u64().unwrap(), p["rank"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        configurations,
        [(0, 0), (2, 4)],
        "the base and the most mixed"
    );
    for profile in &profiles {
        assert_eq!(profile["kind"], "stages");
        assert!(profile["plain_ms"].as_f64().unwrap() > 0.0, "{profile}");
        let stages = profile["stages"].as_array().unwrap();
        let fc1 = stages.iter().find(|s| s["stage"] == "fc1").unwrap();
        assert_eq!(fc1["marks"], 2, "one fc1 per block: {fc1}");
        assert!(fc1["tflop_per_s"].as_f64().unwrap() > 0.0, "{fc1}");
    }

    let table = assert_success(&mmlora(&args));
    assert!(
        table.contains("TFLOP/s") && table.contains("lora_op"),
        "{table}"
    );
    let out = mmlora(&[&args[..], &["--scale"]].concat());
    assert!(!out.status.success(), "--stages and --scale are two runs");
}

#[test]
fn bench_counts_out_of_range_are_refused_by_flag_before_any_work() {
    // Each of these but --repeats 0 (which ran one round anyway) used to allocate for the count
    // first: an abort (exit 134) or a panic.
    for (flag, value) in [
        ("--repeats", "18446744073709551615"),
        ("--repeats", "0"),
        ("--images", "100000"),
        ("--side", "100000"),
        ("--adapters", "1000000000000"),
        ("--ranks", "1000"),
        ("--op-rows", "1000000000000"),
    ] {
        let out = mmlora(&["bench", "--preset", "tiny", "--device", "cpu", flag, value]);
        assert_eq!(out.status.code(), Some(1), "{flag} {value}");
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains(&format!("{flag} {value} is outside")),
            "{stderr}"
        );
    }
    // Counts within range each, too many tower rows together (1024 images resized to 980²
    // are 5 million rows, 23 GB of patches): refused before the patches are made.
    for scale in [&[][..], &["--scale", "--scale-images", "1024"]] {
        let images = if scale.is_empty() {
            &["--images", "1024"][..]
        } else {
            &[]
        };
        let args = [
            &[
                "bench", "--preset", "tiny", "--device", "cpu", "--side", "8192",
            ][..],
            images,
            scale,
        ]
        .concat();
        let out = mmlora(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let stderr = text(&out.stderr);
        assert!(stderr.contains("tower rows, above"), "{args:?}: {stderr}");
    }
}

#[test]
fn an_unknown_wgpu_backend_is_an_error_under_auto_too() {
    refused_under_backend(&["encode", "--device", "auto"], "vulcan");
}
