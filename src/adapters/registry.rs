//! The adapters an engine knows by name, and a CPU-side LRU of their loaded weights.
//!
//! A name is registered with the folder it was loaded from. Its weights stay in memory while
//! they are among the `capacity` most recently used; an evicted adapter is read again from its
//! folder (and validated again) the next time a request needs it. Every load gets a fresh
//! [`AdapterKey`], so anything cached downstream (the GPU slots) is keyed on the content that
//! was loaded, never on the name: re-loading a name can never serve the old weights.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use super::PeftAdapter;
use crate::routing::mapping::AdapterId;

/// Identifies one load of one adapter's content; doubles as the mapping's adapter id (never 0).
pub type AdapterKey = AdapterId;

/// A registered adapter: where it comes from and the key of its current content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// The folder it is loaded from.
    pub dir: PathBuf,
    /// The key of the content loaded last.
    pub key: AdapterKey,
}

/// Registered adapters and the LRU of their weights.
#[derive(Debug, Clone)]
pub struct AdapterRegistry {
    capacity: usize,
    names: BTreeMap<String, Registration>,
    loaded: HashMap<AdapterKey, Arc<PeftAdapter>>,
    /// Keys of `loaded`, least recently used first.
    recency: Vec<AdapterKey>,
    next_key: AdapterKey,
}

impl AdapterRegistry {
    /// An empty registry that keeps at most `capacity` adapters' weights in memory (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            names: BTreeMap::new(),
            loaded: HashMap::new(),
            recency: Vec::new(),
            next_key: 1,
        }
    }

    /// Registers `adapter` under its name (replacing any adapter of that name) and returns its
    /// key. Call only with a fully validated adapter: this cannot fail.
    pub fn insert(&mut self, adapter: PeftAdapter) -> AdapterKey {
        let key = self.next_key;
        self.next_key += 1;
        if let Some(old) = self.names.insert(
            adapter.name.clone(),
            Registration {
                dir: adapter.dir.clone(),
                key,
            },
        ) {
            self.forget(old.key);
        }
        self.loaded.insert(key, Arc::new(adapter));
        self.recency.push(key);
        while self.recency.len() > self.capacity {
            let victim = self.recency.remove(0);
            self.loaded.remove(&victim);
        }
        key
    }

    /// Removes `name`; returns whether it was registered.
    pub fn remove(&mut self, name: &str) -> bool {
        match self.names.remove(name) {
            Some(registration) => {
                self.forget(registration.key);
                true
            }
            None => false,
        }
    }

    /// The registration of `name`.
    pub fn registration(&self, name: &str) -> Option<&Registration> {
        self.names.get(name)
    }

    /// The registered names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.keys().map(String::as_str)
    }

    /// The weights of `key` if they are in memory, marking them most recently used.
    pub fn touch(&mut self, key: AdapterKey) -> Option<Arc<PeftAdapter>> {
        let adapter = self.loaded.get(&key)?.clone();
        self.recency.retain(|&k| k != key);
        self.recency.push(key);
        Some(adapter)
    }

    /// The weights of `key` if they are in memory, without changing the LRU order.
    pub fn get(&self, key: AdapterKey) -> Option<&Arc<PeftAdapter>> {
        self.loaded.get(&key)
    }

    /// The adapters whose weights are in memory.
    pub fn in_memory(&self) -> impl Iterator<Item = &PeftAdapter> {
        self.loaded.values().map(Arc::as_ref)
    }

    /// How many adapters' weights are in memory.
    #[cfg(test)]
    pub fn loaded_count(&self) -> usize {
        self.loaded.len()
    }

    fn forget(&mut self, key: AdapterKey) {
        self.loaded.remove(&key);
        self.recency.retain(|&k| k != key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapter(name: &str) -> PeftAdapter {
        PeftAdapter {
            name: name.to_owned(),
            dir: PathBuf::from(format!("/adapters/{name}")),
            config: serde_json::from_str(r#"{"r": 1, "lora_alpha": 1}"#).unwrap(),
            modules: BTreeMap::new(),
        }
    }

    #[test]
    fn reloading_a_name_gives_a_new_key_and_drops_the_old_weights() {
        let mut registry = AdapterRegistry::new(4);
        let first = registry.insert(adapter("a"));
        let second = registry.insert(adapter("a"));
        assert_ne!(first, second);
        assert!(registry.get(first).is_none());
        assert_eq!(registry.registration("a").unwrap().key, second);
        assert_eq!(registry.loaded_count(), 1);
    }

    #[test]
    fn the_least_recently_used_weights_are_evicted_but_the_name_stays() {
        let mut registry = AdapterRegistry::new(2);
        let a = registry.insert(adapter("a"));
        let b = registry.insert(adapter("b"));
        assert!(registry.touch(a).is_some()); // b is now the least recently used
        let c = registry.insert(adapter("c"));
        assert!(registry.get(b).is_none());
        assert!(registry.get(a).is_some() && registry.get(c).is_some());
        assert_eq!(registry.names().collect::<Vec<_>>(), ["a", "b", "c"]);
    }

    #[test]
    fn removing_a_name_forgets_it() {
        let mut registry = AdapterRegistry::new(2);
        let a = registry.insert(adapter("a"));
        assert!(registry.remove("a"));
        assert!(!registry.remove("a"));
        assert!(registry.get(a).is_none() && registry.registration("a").is_none());
    }
}
