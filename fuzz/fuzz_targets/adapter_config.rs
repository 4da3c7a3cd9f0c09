//! `cargo fuzz run adapter_config`: [`mmlora::fuzzing::adapter_config`] on the fuzzer's bytes.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mmlora::fuzzing::adapter_config(data));
