//! The `mmlora` binary, spawned as a user would run it.

use std::process::{Command, Output};

fn mmlora(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mmlora"))
        .args(args)
        .output()
        .expect("the mmlora binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn demo_on_cpu_prints_one_line_per_image() {
    let out = mmlora(&[
        "demo",
        "--device",
        "cpu",
        "--images",
        "3",
        "--adapters",
        "2",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("device: cpu"), "{stdout}");
    for (image, adapter) in [(0, "none"), (1, "adapter-1"), (2, "adapter-2")] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("image-{image}:")))
            .unwrap_or_else(|| panic!("no line for image-{image} in {stdout}"));
        assert!(line.contains(adapter), "{line}");
    }
}

#[test]
fn demo_on_gpu_runs_where_ci_promises_one() {
    let out = mmlora(&[
        "demo",
        "--device",
        "gpu",
        "--images",
        "2",
        "--adapters",
        "1",
    ]);
    let stderr = text(&out.stderr);
    if !out.status.success() && stderr.contains("no GPU adapter") {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "CI=true requires a GPU adapter (lavapipe in CI): {stderr}"
        );
        return;
    }
    assert!(out.status.success(), "{stderr}");
    assert!(text(&out.stdout).contains("adapter-1"));
}

#[test]
fn devices_lists_what_wgpu_sees() {
    let out = mmlora(&["devices"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("mmlora"));
}

#[test]
fn bad_arguments_fail_with_a_message_and_no_panic() {
    for args in [
        &["demo", "--device", "tpu"][..],
        &["demo", "--rank", "0", "--device", "cpu"],
        &["demo", "--rank", "513", "--device", "cpu"],
        &["demo", "--images", "0", "--device", "cpu"],
        &["frobnicate"],
    ] {
        let out = mmlora(args);
        let stderr = text(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
        assert!(!stderr.trim().is_empty(), "{args:?} said nothing");
    }
}
