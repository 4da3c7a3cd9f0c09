//! The adapters an engine holds: loading, registering and forgetting them, and reading back
//! the weights a step needs that were evicted from host memory.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use super::{Engine, EngineError, Request};
use crate::adapters::PeftAdapter;
use crate::adapters::registry::AdapterKey;
use crate::runtime::device::Precision;

impl Engine {
    /// Loads the PEFT folder `dir` as `name`, replacing any adapter of that name. The adapter is
    /// fully validated first: on error the engine is unchanged.
    pub fn load_adapter(
        &mut self,
        name: &str,
        dir: &Path,
    ) -> Result<Arc<PeftAdapter>, EngineError> {
        let key = self.read_adapter(name, dir)?;
        Ok(self.loaded(key))
    }

    /// Registers an adapter built in memory under its name, after checking it against the model.
    /// Should its weights be evicted from memory, they are read again from `adapter.dir`.
    pub fn insert_adapter(
        &mut self,
        adapter: PeftAdapter,
    ) -> Result<Arc<PeftAdapter>, EngineError> {
        adapter.check(&self.model.lora_targets(), self.options.max_rank)?;
        self.register(adapter)
    }

    /// Registers an adapter already validated against this model's targets, once its weights
    /// fit the engine's precision; returns its key.
    fn admit(&mut self, adapter: PeftAdapter) -> Result<AdapterKey, EngineError> {
        if self.options.precision == Precision::F16 {
            adapter.check_fits_f16()?;
        }
        Ok(self.registry.insert(adapter))
    }

    /// [`Self::admit`], returning the weights (marked most recently used).
    pub(super) fn register(
        &mut self,
        adapter: PeftAdapter,
    ) -> Result<Arc<PeftAdapter>, EngineError> {
        let key = self.admit(adapter)?;
        Ok(self.loaded(key))
    }

    /// The weights of an adapter just registered (so in memory), marked most recently used.
    fn loaded(&mut self, key: AdapterKey) -> Arc<PeftAdapter> {
        self.registry
            .touch(key)
            .expect("an adapter just registered is in memory")
    }

    /// Reads, validates and registers an adapter; returns the key of its content.
    fn read_adapter(&mut self, name: &str, dir: &Path) -> Result<AdapterKey, EngineError> {
        let targets = self.model.lora_targets();
        let adapter = PeftAdapter::load(name, dir, &targets, self.options.max_rank)?;
        let key = self.admit(adapter)?;
        tracing::info!(adapter = name, dir = %dir.display(), "adapter loaded");
        Ok(key)
    }

    /// Forgets the adapter `name`.
    pub fn unload_adapter(&mut self, name: &str) -> Result<(), EngineError> {
        if self.registry.remove(name) {
            Ok(())
        } else {
            Err(EngineError::NotLoaded(name.to_owned()))
        }
    }

    /// The names of the loaded adapters, sorted.
    pub fn adapter_names(&self) -> Vec<String> {
        self.registry.names().map(str::to_owned).collect()
    }

    /// Refuses requests that name adapters which are not loaded.
    pub(super) fn check_adapters(&self, requests: &[Request]) -> Result<(), EngineError> {
        for request in requests {
            if let Some(adapter) = &request.adapter
                && self.registry.registration(adapter).is_none()
            {
                return Err(EngineError::UnknownAdapter {
                    request: request.id.clone(),
                    adapter: adapter.clone(),
                    loaded: self.adapter_names().join(", "),
                });
            }
        }
        Ok(())
    }

    /// Makes sure the named adapters' weights are in memory (reading evicted ones again from
    /// their folders) and returns each one's key.
    pub(super) fn step_adapters<'a>(
        &mut self,
        names: impl Iterator<Item = &'a str>,
    ) -> Result<HashMap<String, AdapterKey>, EngineError> {
        let mut keys = HashMap::new();
        let mut evicted = Vec::new();
        // Touch the adapters in memory first, so reading the others back evicts none of them.
        for name in names {
            if keys.contains_key(name) || evicted.contains(&name) {
                continue;
            }
            let key = self
                .registry
                .registration(name)
                .expect("encode checked every adapter name")
                .key;
            match self.registry.touch(key) {
                Some(_) => {
                    keys.insert(name.to_owned(), key);
                }
                None => evicted.push(name),
            }
        }
        for name in evicted {
            let dir = self
                .registry
                .registration(name)
                .expect("encode checked every adapter name")
                .dir
                .clone();
            tracing::info!(
                adapter = name,
                "reading back an adapter evicted from memory"
            );
            let key = self.read_adapter(name, &dir)?;
            keys.insert(name.to_owned(), key);
        }
        Ok(keys)
    }
}
