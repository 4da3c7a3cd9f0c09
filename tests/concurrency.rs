//! One engine, many threads: encoding while adapters are loaded, replaced and unloaded never
//! gives a result computed with a half-written or wrong adapter, and a name loaded again with
//! new content serves that content from the next call on.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use common::{copy_dir, edit_json, errors, fixture_dir};
use mmlora::engine::{Engine, EngineError, EngineOptions, ImageSource, Request, SharedEngine};
use mmlora::runtime::device::{self, RuntimeDevice};

fn adapter_dir(name: &str) -> PathBuf {
    fixture_dir().join("adapters").join(name)
}

fn request(id: &str, image: &str, adapter: Option<&str>) -> Request {
    Request {
        id: id.to_owned(),
        image: ImageSource::File(fixture_dir().join("images").join(image)),
        adapter: adapter.map(str::to_owned),
    }
}

/// What one request gives when run alone with the adapter folder `content` (or none).
fn alone(on: &RuntimeDevice, image: &str, content: Option<&str>) -> Vec<f32> {
    let mut engine = Engine::open(&fixture_dir(), on.clone(), EngineOptions::default()).unwrap();
    if let Some(content) = content {
        engine.load_adapter("x", &adapter_dir(content)).unwrap();
    }
    let request = request("alone", image, content.map(|_| "x"));
    engine
        .encode(&[request], false)
        .unwrap()
        .remove(0)
        .embeds
        .values
}

/// Four threads encode a mixed batch in a loop while a fifth swaps the content of adapter
/// `swap` between two folders and sometimes unloads it.
fn encode_while_swapping(on: &RuntimeDevice, rounds: usize, rel_tol: f64) {
    const CONTENTS: [&str; 2] = ["all-r4", "rslora-r8"];
    let images = ["square.png", "wide.jpg"];
    let mut expected: HashMap<(&str, Option<&str>), Vec<f32>> = HashMap::new();
    for image in images {
        for content in [None, Some("all-r4"), Some("rslora-r8"), Some("tower-r2")] {
            expected.insert((image, content), alone(on, image, content));
        }
    }
    let engine = Engine::open(&fixture_dir(), on.clone(), EngineOptions::default()).unwrap();
    let shared = SharedEngine::new(engine);
    shared
        .load_adapter("steady", &adapter_dir("tower-r2"))
        .unwrap();
    shared
        .load_adapter("swap", &adapter_dir(CONTENTS[0]))
        .unwrap();

    let done = Arc::new(AtomicBool::new(false));
    let (served, unknown) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    // How many batches served each content of `swap`.
    let by_content = Arc::new(CONTENTS.map(|_| AtomicUsize::new(0)));
    // Batches finished, served or refused. After each swap the swapper waits for more of them
    // than there are workers: one worker has then finished two, the second begun after the
    // swap, so every content is seen by some batch, however the lock is handed out.
    let finished = Arc::new(AtomicUsize::new(0));
    const WORKERS: usize = 4;
    std::thread::scope(|scope| {
        let swapper = {
            let (shared, done, finished) = (shared.clone(), done.clone(), finished.clone());
            scope.spawn(move || {
                let mut swaps = 0;
                while !done.load(Ordering::Relaxed) {
                    swaps += 1;
                    if swaps % 5 == 0 {
                        shared.unload_adapter("swap").unwrap();
                    } else {
                        shared
                            .load_adapter("swap", &adapter_dir(CONTENTS[swaps % 2]))
                            .unwrap();
                    }
                    let after = finished.load(Ordering::SeqCst) + WORKERS + 1;
                    while !done.load(Ordering::Relaxed) && finished.load(Ordering::SeqCst) < after {
                        std::thread::yield_now();
                    }
                }
                swaps
            })
        };
        let workers: Vec<_> = (0..WORKERS)
            .map(|t| {
                let (shared, expected) = (shared.clone(), &expected);
                let (served, unknown) = (served.clone(), unknown.clone());
                let (by_content, finished) = (by_content.clone(), finished.clone());
                scope.spawn(move || {
                    for round in 0..rounds {
                        let image = images[(t + round) % 2];
                        let batch = [
                            request("swap", image, Some("swap")),
                            request("steady", image, Some("steady")),
                            request("base", image, None),
                        ];
                        let results = match shared.encode(&batch, false) {
                            Ok(results) => results,
                            Err(EngineError::UnknownAdapter { adapter, .. })
                                if adapter == "swap" =>
                            {
                                unknown.fetch_add(1, Ordering::Relaxed);
                                finished.fetch_add(1, Ordering::SeqCst);
                                continue;
                            }
                            Err(other) => panic!("thread {t} round {round}: {other}"),
                        };
                        let close = |values: &[f32], content| {
                            errors(values, &expected[&(image, content)]).0 <= rel_tol
                        };
                        let swapped = &results[0].embeds.values;
                        let content = CONTENTS.iter().position(|&c| close(swapped, Some(c)));
                        let content = content.unwrap_or_else(|| {
                            panic!("thread {t} round {round}: `swap` matches neither content")
                        });
                        by_content[content].fetch_add(1, Ordering::Relaxed);
                        assert!(close(&results[1].embeds.values, Some("tower-r2")));
                        assert!(close(&results[2].embeds.values, None));
                        served.fetch_add(1, Ordering::Relaxed);
                        finished.fetch_add(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        let swaps = swapper.join().unwrap();
        let by_content = by_content.each_ref().map(|n| n.load(Ordering::Relaxed));
        println!(
            "on {}: {} batches served ({by_content:?} by content), {} refused while `swap` \
             was unloaded, {swaps} swaps",
            on.description,
            served.load(Ordering::Relaxed),
            unknown.load(Ordering::Relaxed)
        );
        // The interleaving the test is for happened: both contents were served while swapping.
        assert!(
            swaps > 1 && by_content.iter().all(|&n| n > 0),
            "{by_content:?}"
        );
    });

    // From the call after a load on, the new content is served — whichever thread calls.
    for content in [CONTENTS[1], CONTENTS[0], CONTENTS[1]] {
        let loader = shared.clone();
        std::thread::spawn(move || loader.load_adapter("swap", &adapter_dir(content)).unwrap())
            .join()
            .unwrap();
        let results = shared
            .encode(&[request("r", "wide.jpg", Some("swap"))], false)
            .unwrap();
        let (rel, _) = errors(
            &results[0].embeds.values,
            &expected[&("wide.jpg", Some(content))],
        );
        assert!(rel <= rel_tol, "after loading {content}: rel {rel:e}");
    }
}

#[test]
fn encoding_while_adapters_are_swapped_on_cpu() {
    // Tolerance: rel. Frobenius 1e-6 (the same request, only its batch-mates differ).
    encode_while_swapping(&device::cpu(), 40, 1e-6);
}

#[test]
fn encoding_while_adapters_are_swapped_on_wgpu() {
    let Some(gpu) = device::gpu_for_tests() else {
        return;
    };
    // Tolerance: rel. Frobenius 1e-5, as in tests/soak.rs (kernels timed per shape on a
    // hardware GPU may sum in another order for other batch shapes).
    encode_while_swapping(&gpu, 8, 1e-5);
}

/// A panic inside the lock poisons the handle for every clone; `rebuild` opens the engine
/// again from its folder, refusing a folder whose image processor changed meanwhile.
#[test]
fn a_poisoned_shared_engine_is_rebuilt_in_place() {
    let model = tempfile::TempDir::new().unwrap();
    copy_dir(&fixture_dir(), model.path());
    let engine = Engine::open(model.path(), device::cpu(), EngineOptions::default()).unwrap();
    let shared = SharedEngine::new(engine);
    shared.load_adapter("x", &adapter_dir("all-r4")).unwrap();
    let probe = [request("probe", "wide.jpg", Some("x"))];
    let embeds = || {
        let mut results = shared.encode(&probe, false).unwrap();
        results.remove(0).embeds.values
    };
    let before = embeds();

    let clone = shared.clone();
    let panicked = std::thread::spawn(move || clone.with_engine(|_| panic!("poison")))
        .join()
        .is_err();
    assert!(panicked);
    let poisoned = shared.encode(&probe, false).unwrap_err();
    assert!(matches!(poisoned, EngineError::Poisoned), "{poisoned}");

    let processor = model.path().join("preprocessor_config.json");
    let original = std::fs::read(&processor).unwrap();
    edit_json(&processor, |config| {
        config["size"]["longest_edge"] = 12544.into()
    });
    let changed = shared.rebuild(device::cpu()).unwrap_err();
    assert!(changed.to_string().contains("changed"), "{changed}");
    // The failed rebuild kept the poisoned engine.
    assert!(matches!(
        shared.encode(&probe, false),
        Err(EngineError::Poisoned)
    ));

    std::fs::write(&processor, original).unwrap();
    shared.rebuild(device::cpu()).unwrap();
    assert_eq!(shared.adapter_names().unwrap(), ["x"]);
    let after = embeds();
    // Tolerance: rel. Frobenius 1e-6 (the same kernels on the same device).
    let (rel, _) = errors(&after, &before);
    assert!(rel <= 1e-6, "rel {rel:e}");
}
