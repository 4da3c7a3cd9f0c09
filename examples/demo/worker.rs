//! The demo's compute thread: it owns the engines (one per compute device, opened on first
//! use) so the window never waits on the model.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender};
use std::time::Instant;

use mmlora::adapters::PeftAdapter;
use mmlora::analysis::{self, BatchRow, RunResult};
use mmlora::engine::{Engine, EngineError, EngineOptions};
use mmlora::models::LoraTarget;
use mmlora::runtime::device::{self, RuntimeDevice};

/// Where the engine computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compute {
    /// The GPU the window renders on.
    Gpu,
    /// Burn's CPU backend.
    Cpu,
}

/// What the window asks of the worker.
pub enum Job {
    /// Load the PEFT adapter in a folder; loading a folder again reloads it under its name.
    LoadAdapter {
        /// Its PEFT folder.
        dir: PathBuf,
        /// Where to open the model if no engine is open yet.
        on: Compute,
    },
    /// Forget an adapter.
    Unload(String),
    /// Encode a batch in one engine call.
    Run {
        /// The rows.
        rows: Vec<BatchRow>,
        /// Where.
        on: Compute,
    },
}

/// A loaded adapter, as the window lists it.
#[derive(Debug, Clone)]
pub struct AdapterInfo {
    /// Its name: its folder's name, with `-2`, `-3`, … when another folder has that name.
    pub name: String,
    /// Its folder.
    pub dir: PathBuf,
    /// `r`, `lora_alpha` and whether it is rsLoRA.
    pub summary: String,
    /// The layers it covers.
    pub targets: String,
}

impl AdapterInfo {
    fn of(adapter: &PeftAdapter) -> Self {
        let config = &adapter.config;
        let mut kinds: Vec<&str> = adapter
            .modules
            .keys()
            .map(|p| LoraTarget::kind(p))
            .collect();
        kinds.sort_unstable();
        kinds.dedup();
        Self {
            name: adapter.name.clone(),
            dir: adapter.dir.clone(),
            summary: format!(
                "r {} · alpha {}{}",
                config.r,
                config.lora_alpha,
                if config.use_rslora { " · rsLoRA" } else { "" }
            ),
            targets: format!("{} layers: {}", adapter.modules.len(), kinds.join(", ")),
        }
    }
}

/// What the worker tells the window.
pub enum Reply {
    /// An adapter is loaded.
    AdapterLoaded(AdapterInfo),
    /// An adapter is gone.
    AdapterUnloaded(String),
    /// A step of a long job.
    Progress(String),
    /// A batch finished.
    RunDone(Box<RunResult>),
    /// A batch failed; nothing was computed.
    RunFailed(String),
    /// Something failed; the engines and the adapters are as they were.
    Failed(String),
}

/// Serves `jobs` until the window goes away.
pub fn serve(
    model_dir: PathBuf,
    gpu: Option<RuntimeDevice>,
    jobs: Receiver<Job>,
    replies: Sender<Reply>,
    wake: impl Fn(),
) {
    let mut worker = Worker {
        model_dir,
        gpu,
        engines: Vec::new(),
        adapters: Vec::new(),
    };
    for job in jobs {
        let reply = match job {
            Job::LoadAdapter { dir, on } => worker.load(dir, on),
            Job::Unload(name) => worker.unload(&name),
            Job::Run { rows, on } => {
                let _ = replies.send(Reply::Progress(format!("encoding {} rows…", rows.len())));
                wake();
                worker.run(&rows, on)
            }
        };
        if replies.send(reply).is_err() {
            return;
        }
        wake();
    }
}

struct Worker {
    model_dir: PathBuf,
    gpu: Option<RuntimeDevice>,
    /// The engines opened so far, each with every loaded adapter.
    engines: Vec<(Compute, Engine)>,
    /// Every loaded adapter's name and (canonical) folder.
    adapters: Vec<(String, PathBuf)>,
}

impl Worker {
    /// The engine on `on`, opened now if this is its first use: a second engine is the first
    /// one rebuilt on the other device, with its adapters taken from memory.
    fn engine(&mut self, on: Compute) -> Result<&mut Engine, String> {
        if let Some(i) = self.engines.iter().position(|(c, _)| *c == on) {
            return Ok(&mut self.engines[i].1);
        }
        let runtime = match on {
            Compute::Cpu => device::cpu(),
            Compute::Gpu => self.gpu.clone().ok_or("no GPU: use the CPU backend")?,
        };
        let engine = match self.engines.first() {
            Some((_, first)) => first.rebuild(runtime),
            None => Engine::open(&self.model_dir, runtime, EngineOptions::default()),
        }
        .map_err(|e| e.to_string())?;
        self.engines.push((on, engine));
        Ok(&mut self.engines.last_mut().expect("just pushed").1)
    }

    fn load(&mut self, dir: PathBuf, on: Compute) -> Reply {
        match self.try_load(&dir, on) {
            Ok(info) => Reply::AdapterLoaded(info),
            Err(error) => Reply::Failed(error),
        }
    }

    /// Reads and checks the adapter once, against every open engine (opening the one on `on`
    /// if none is), before it goes into any of them: an adapter that fails changes nothing.
    fn try_load(&mut self, dir: &Path, on: Compute) -> Result<AdapterInfo, String> {
        let dir = std::fs::canonicalize(dir)
            .map_err(|e| format!("cannot read the adapter folder {}: {e}", dir.display()))?;
        let name = self.name_for(&dir);
        if self.engines.is_empty() {
            self.engine(on)?;
        }
        let (_, first) = &self.engines[0];
        let adapter = PeftAdapter::load(
            &name,
            &dir,
            &first.model().lora_targets(),
            first.options().max_rank,
        )
        .map_err(|e| e.to_string())?;
        for (_, engine) in self.engines.iter().skip(1) {
            adapter
                .check(&engine.model().lora_targets(), engine.options().max_rank)
                .map_err(|e| e.to_string())?;
        }
        for (_, engine) in &mut self.engines {
            // Only the checks above can fail here (the demo's engines compute in f32, so the
            // f16 range check cannot).
            engine
                .insert_adapter(adapter.clone())
                .map_err(|e| e.to_string())?;
        }
        self.adapters.retain(|(n, _)| *n != name);
        self.adapters.push((name, dir));
        Ok(AdapterInfo::of(&adapter))
    }

    /// The name of the adapter in `dir`: the one it has if that folder is loaded (a reload
    /// replaces it), else the folder's name, with `-2`, `-3`, … if another folder has it.
    fn name_for(&self, dir: &Path) -> String {
        if let Some((name, _)) = self.adapters.iter().find(|(_, d)| d == dir) {
            return name.clone();
        }
        let base = PeftAdapter::name_for(dir);
        let taken = |name: &str| self.adapters.iter().any(|(n, _)| n == name);
        let mut name = base.clone();
        let mut count = 1;
        while taken(&name) {
            count += 1;
            name = format!("{base}-{count}");
        }
        name
    }

    fn unload(&mut self, name: &str) -> Reply {
        for (_, engine) in &mut self.engines {
            let _ = engine.unload_adapter(name);
        }
        self.adapters.retain(|(n, _)| n != name);
        Reply::AdapterUnloaded(name.to_owned())
    }

    fn run(&mut self, rows: &[BatchRow], on: Compute) -> Reply {
        match self.try_run(rows, on) {
            Ok(result) => Reply::RunDone(Box::new(result)),
            Err(error) => Reply::RunFailed(error),
        }
    }

    fn try_run(&mut self, rows: &[BatchRow], on: Compute) -> Result<RunResult, String> {
        if rows.is_empty() {
            return Err("the batch is empty: add a row".to_owned());
        }
        let requests = analysis::requests(rows);
        let engine = self.engine(on)?;
        let device = engine.device().description.clone();
        let merge = engine.model().layout().spatial_merge_size;
        let started = Instant::now();
        let encoded = match engine.encode(&requests, true) {
            Ok(encoded) => encoded,
            // The demo's GPU is the window's too, so there is no new one to rebuild on: the
            // CPU backend goes on, with the adapters the GPU engine held if it was the only one.
            Err(EngineError::DeviceLost(reason)) => {
                self.gpu = None;
                let ran = self.engines.iter().position(|(c, _)| *c == on);
                let (_, lost) = self
                    .engines
                    .remove(ran.expect("the engine that ran is kept"));
                if self.engines.is_empty() {
                    let cpu = lost.rebuild(device::cpu()).map_err(|e| {
                        format!("the GPU was lost ({reason}), and the CPU backend failed: {e}")
                    })?;
                    self.engines.push((Compute::Cpu, cpu));
                }
                return Err(format!(
                    "the GPU was lost ({reason}); the CPU backend still runs"
                ));
            }
            Err(error) => return Err(error.to_string()),
        };
        let seconds = started.elapsed().as_secs_f64();
        Ok(analysis::summarise(rows, &encoded, merge, seconds, device))
    }
}
