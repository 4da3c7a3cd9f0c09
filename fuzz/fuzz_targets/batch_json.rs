//! Batch files: a typed error naming the file, or a batch with at least one request, unique
//! ids, and every adapter a request names listed.

#![no_main]

use std::collections::HashSet;
use std::path::Path;

use libfuzzer_sys::fuzz_target;
use mmlora::engine::batch::{Batch, BatchError};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("/jobs/batch.json");
    match Batch::parse(text, path) {
        Err(BatchError::Invalid { path: named, .. }) => assert_eq!(named, path),
        Err(other) => panic!("parsing text cannot fail to read: {other}"),
        Ok(batch) => {
            assert!(!batch.requests.is_empty());
            let mut ids = HashSet::new();
            for request in &batch.requests {
                assert!(ids.insert(&request.id), "duplicate id {}", request.id);
                if let Some(adapter) = &request.adapter {
                    assert!(batch.adapters.iter().any(|(name, _)| name == adapter));
                }
            }
        }
    }
});
