//! The desktop demo (`examples/demo`) under a virtual X server with whatever Vulkan driver the
//! machine has (lavapipe in CI): it starts, runs the preset batch, and saves a screenshot that
//! shows a real frame.

use std::path::PathBuf;
use std::process::Command;

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

#[test]
fn demo_runs_the_preset_batch_and_saves_a_real_screenshot() {
    if !on_path("xvfb-run") {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "CI=true requires xvfb-run (apt-get install xvfb)"
        );
        eprintln!("xvfb-run is not installed: the demo test did not run");
        return;
    }
    let demo = demo_binary();
    assert!(demo.is_file(), "{} was not built", demo.display());
    let dir = tempfile::TempDir::new().unwrap();
    let shot = dir.path().join("demo.png");
    let out = Command::new("xvfb-run")
        .args(["-a", "-s", "-screen 0 1600x1000x24"])
        .arg(&demo)
        .arg("--screenshot")
        .arg(&shot)
        .args(["--frames", "5"])
        .env("XDG_RUNTIME_DIR", dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");

    let image = image::open(&shot).unwrap().to_rgba8();
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
