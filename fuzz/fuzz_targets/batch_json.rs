//! `cargo fuzz run batch_json`: [`mmlora::fuzzing::batch_json`] on the fuzzer's bytes.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mmlora::fuzzing::batch_json(data));
