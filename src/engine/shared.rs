//! One engine for many threads: a cloneable handle that is `Send + Sync`.
//!
//! Image files are decoded and adapter folders read and validated on the calling thread,
//! outside the lock, so threads overlap their file work (an adapter evicted from memory is
//! read back inside it, by the step that needs it). The device work of an `encode` call
//! and every change to the set of adapters take one lock, so a call runs entirely with the
//! adapters as they were when its device work began: never with a half-loaded adapter, and a
//! name loaded again with new content serves that content from the next call on.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use super::checks::{check_ids, request_patches};
use super::{Encoded, Engine, EngineError, Request};
use crate::adapters::PeftAdapter;
use crate::models::{LoraTarget, PatchLayout};
use crate::preprocess::{ImageBackend, PreprocessConfig};
use crate::runtime::device::RuntimeDevice;

/// A cloneable handle on one [`Engine`], usable from any thread.
#[derive(Debug, Clone)]
pub struct SharedEngine {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    engine: Mutex<Engine>,
    /// What file work needs, copied out so it runs without the lock.
    preprocess: PreprocessConfig,
    image_backend: ImageBackend,
    layout: PatchLayout,
    targets: Vec<LoraTarget>,
    max_rank: usize,
}

impl SharedEngine {
    /// Shares `engine`.
    pub fn new(engine: Engine) -> Self {
        Self {
            inner: Arc::new(Inner {
                preprocess: engine.preprocess_config().clone(),
                image_backend: engine.options().image_backend,
                layout: engine.model().layout(),
                targets: engine.model().lora_targets(),
                max_rank: engine.options().max_rank,
                engine: Mutex::new(engine),
            }),
        }
    }

    /// [`Engine::load_adapter`]: the folder is read and validated before the lock is taken.
    pub fn load_adapter(&self, name: &str, dir: &Path) -> Result<Arc<PeftAdapter>, EngineError> {
        let adapter = PeftAdapter::load(name, dir, &self.inner.targets, self.inner.max_rank)?;
        self.lock()?.register(adapter)
    }

    /// [`Engine::insert_adapter`]: the weights are checked against the model before the lock
    /// is taken.
    pub fn insert_adapter(&self, adapter: PeftAdapter) -> Result<Arc<PeftAdapter>, EngineError> {
        adapter.check(&self.inner.targets, self.inner.max_rank)?;
        self.lock()?.register(adapter)
    }

    /// [`Engine::unload_adapter`]: calls already running finish with the adapter.
    pub fn unload_adapter(&self, name: &str) -> Result<(), EngineError> {
        self.lock()?.unload_adapter(name)
    }

    /// [`Engine::adapter_names`].
    pub fn adapter_names(&self) -> Result<Vec<String>, EngineError> {
        Ok(self.lock()?.adapter_names())
    }

    /// [`Engine::encode`]: images are decoded before the lock is taken.
    pub fn encode(
        &self,
        requests: &[Request],
        with_tower: bool,
    ) -> Result<Vec<Encoded>, EngineError> {
        check_ids(requests)?;
        let patches = requests
            .iter()
            .map(|request| {
                request_patches(
                    request,
                    &self.inner.preprocess,
                    self.inner.image_backend,
                    self.inner.layout,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut engine = self.lock()?;
        engine.check_adapters(requests)?;
        pollster::block_on(engine.encode_patches(requests, &patches, with_tower))
    }

    /// Runs `f` on the engine, holding the lock. `f` must keep the engine's model and image
    /// processor: the handle decodes images and checks adapters against those it was made
    /// with.
    pub fn with_engine<R>(&self, f: impl FnOnce(&mut Engine) -> R) -> Result<R, EngineError> {
        Ok(f(&mut *self.lock()?))
    }

    /// [`Engine::rebuild`] in place, for every clone of this handle: after
    /// [`EngineError::DeviceLost`], or a panic that poisoned the lock, the engine is opened
    /// again from its model folder on `device`, with the same adapters, and the next call of
    /// any clone runs on it. After a panic, the adapters are those registered when it struck
    /// (a panic inside a registry change, which no input causes, could leave that change
    /// half made). On an error the handle keeps the engine it had. The folder must
    /// still hold a model this handle's copies fit: one whose patch layout, LoRA targets or
    /// image-processor config changed is refused, since the handle decodes images and checks
    /// adapters against the old ones.
    pub fn rebuild(&self, device: RuntimeDevice) -> Result<(), EngineError> {
        // A poisoned engine is replaced; its options, model folder and adapters carry over.
        let mut engine = self
            .inner
            .engine
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let rebuilt = engine.rebuild(device)?;
        if rebuilt.model().layout() != self.inner.layout
            || rebuilt.model().lora_targets() != self.inner.targets
            || rebuilt.preprocess_config() != &self.inner.preprocess
        {
            return Err(EngineError::Options(
                "the model folder changed since this handle was made; make a new SharedEngine"
                    .to_owned(),
            ));
        }
        *engine = rebuilt;
        self.inner.engine.clear_poison();
        Ok(())
    }

    fn lock(&self) -> Result<MutexGuard<'_, Engine>, EngineError> {
        self.inner.engine.lock().map_err(|_| EngineError::Poisoned)
    }
}

/// The handle crosses threads.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<SharedEngine>();
};
