//! The desktop demo (`examples/demo`) under a virtual X server with whatever Vulkan driver the
//! machine has (lavapipe in CI): it starts, runs the preset batch, and saves a screenshot that
//! shows a real frame; with a model folder that lacks the bundled adapters it starts cleanly.
//! Its compute thread is tested on its own too.

// The demo's compute thread and what it computes, without the window; some of what the window
// reads goes unread here.
#[allow(dead_code)]
#[path = "../examples/demo/worker.rs"]
mod worker;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::mpsc::channel;

use mmlora::analysis::BatchRow;
use tempfile::TempDir;
use worker::{Compute, Job, Reply};

/// Where cargo put the demo: next to this test's own folder (`cargo test` builds examples).
fn demo_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    profile_dir
        .join("examples")
        .join(format!("demo{}", std::env::consts::EXE_SUFFIX))
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
}

/// The `x0 y0 x1 y1` pixel rectangle the demo printed for `name`.
fn printed_rect(stdout: &str, name: &str) -> [u32; 4] {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .unwrap_or_else(|| panic!("the demo printed no {name} area: {stdout}"));
    let numbers: Vec<u32> = line.split(' ').map(|n| n.parse().unwrap()).collect();
    numbers.try_into().unwrap()
}

/// The bundled model folder.
fn bundled() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-qwen2-vl")
}

/// Whether the demo can run here (xvfb-run on the path); CI=true requires it.
fn have_xvfb() -> bool {
    if on_path("xvfb-run") {
        return true;
    }
    assert_ne!(
        std::env::var("CI").as_deref(),
        Ok("true"),
        "CI=true requires xvfb-run (apt-get install xvfb)"
    );
    eprintln!("xvfb-run is not installed: the demo test did not run");
    false
}

/// Runs the demo under xvfb with `args` until it saved a screenshot to `shot` and exited.
fn run_demo(shot: &Path, args: &[&std::ffi::OsStr]) -> Output {
    let demo = demo_binary();
    assert!(demo.is_file(), "{} was not built", demo.display());
    let runtime_dir = TempDir::new().unwrap();
    Command::new("xvfb-run")
        .args(["-a", "-s", "-screen 0 1600x1000x24"])
        .arg(&demo)
        .arg("--screenshot")
        .arg(shot)
        .args(["--frames", "5"])
        .args(args)
        .env("XDG_RUNTIME_DIR", runtime_dir.path())
        .output()
        .unwrap()
}

/// Copies the files of folder `from` (not its subfolders) into `to`.
fn copy_files(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
        }
    }
}

#[test]
fn demo_runs_the_preset_batch_and_saves_a_real_screenshot() {
    if !have_xvfb() {
        return;
    }
    let dir = TempDir::new().unwrap();
    let shot = dir.path().join("demo.png");
    assert_real_screenshot(&run_demo(&shot, &[]), &shot);
}

/// The other families' tiny models (what the window's model picker offers beside the bundled
/// one) run their preset batch and draw it.
#[test]
fn demo_runs_each_familys_tiny_model() {
    if !have_xvfb() {
        return;
    }
    for family in ["tiny-qwen2.5-vl", "tiny-qwen3-vl"] {
        let model = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("assets")
            .join(family);
        let dir = TempDir::new().unwrap();
        let shot = dir.path().join("demo.png");
        let out = run_demo(&shot, &["--model".as_ref(), model.as_os_str()]);
        assert_real_screenshot(&out, &shot);
    }
}

/// The demo exited cleanly and its screenshot `shot` is a real frame with the heatmap and the
/// results drawn.
fn assert_real_screenshot(out: &Output, shot: &Path) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");

    let image = image::open(shot).unwrap().to_rgba8();
    assert!(
        image.width() >= 1000 && image.height() >= 700,
        "screenshot is {}×{}",
        image.width(),
        image.height()
    );
    // The heatmap (the image under per-patch colours) and the results table are drawn: many
    // distinct colours in each, not a cleared or uniform frame.
    for name in ["heatmap", "results"] {
        let [x0, y0, x1, y1] = printed_rect(&stdout, name);
        assert!(
            x1 <= image.width() && y1 <= image.height(),
            "{name} area off the frame"
        );
        let mut colours: Vec<[u8; 4]> = (y0..y1)
            .flat_map(|y| (x0..x1).map(move |x| (x, y)))
            .map(|(x, y)| image.get_pixel(x, y).0)
            .collect();
        colours.sort_unstable();
        colours.dedup();
        assert!(
            colours.len() >= 50,
            "{name} area has {} colours",
            colours.len()
        );
    }
}

#[test]
fn demo_with_a_model_without_the_bundled_adapters_starts_cleanly() {
    if !have_xvfb() {
        return;
    }
    // The bundled model and its images, without its adapters: the preset batch keeps the one
    // row without an adapter.
    let dir = TempDir::new().unwrap();
    let model = dir.path().join("model");
    copy_files(&bundled(), &model);
    copy_files(&bundled().join("images"), &model.join("images"));
    let shot = dir.path().join("demo.png");
    let out = run_demo(&shot, &["--model".as_ref(), model.as_os_str()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    assert!(!stderr.contains("demo errors"), "{stderr}");
    printed_rect(&stdout, "results");
}

#[test]
fn worker_names_adapters_by_folder_and_a_failed_load_changes_nothing() {
    let bundled = bundled();
    let all_r4 = bundled.join("adapters/all-r4");
    let dir = TempDir::new().unwrap();
    // Three more folders named all-r4: a copy, a broken one, and another copy.
    let copy = dir.path().join("copy/all-r4");
    let broken = dir.path().join("broken/all-r4");
    let again = dir.path().join("again/all-r4");
    copy_files(&all_r4, &copy);
    copy_files(&all_r4, &again);
    copy_files(&all_r4, &broken);
    std::fs::write(broken.join("adapter_model.safetensors"), b"not safetensors").unwrap();

    let (jobs, queue) = channel();
    let (answers, replies) = channel();
    let model = bundled.clone();
    let thread = std::thread::spawn(move || worker::serve(model, None, queue, answers, || {}));
    for folder in [&all_r4, &copy, &broken, &again, &all_r4] {
        let job = Job::LoadAdapter {
            dir: folder.clone(),
            on: Compute::Cpu,
        };
        jobs.send(job).unwrap();
    }
    let image = bundled.join("images/square.png");
    let rows: Vec<BatchRow> = ["all-r4", "all-r4-2", "all-r4-3"]
        .into_iter()
        .map(|name| BatchRow {
            image: image.clone(),
            adapter: Some(name.to_owned()),
        })
        .collect();
    jobs.send(Job::Run {
        rows,
        on: Compute::Cpu,
    })
    .unwrap();
    drop(jobs);
    thread.join().unwrap();

    let mut loaded = Vec::new();
    let mut failed = Vec::new();
    let mut done = None;
    for reply in replies.iter() {
        match reply {
            Reply::AdapterLoaded(info) => loaded.push(info.name),
            Reply::Failed(error) => failed.push(error),
            Reply::RunDone(result) => done = Some(result),
            Reply::RunFailed(error) => panic!("the run failed: {error}"),
            Reply::AdapterUnloaded(_) | Reply::Progress(_) => {}
        }
    }
    // Another folder of a loaded name gets a new name, the broken one takes none, and loading
    // a folder again keeps its name.
    assert_eq!(loaded, ["all-r4", "all-r4-2", "all-r4-3", "all-r4"]);
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(
        failed[0].contains(&broken.canonicalize().unwrap().display().to_string()),
        "{}",
        failed[0]
    );
    let result = done.expect("the batch ran");
    assert_eq!(result.rows.len(), 3);
}
