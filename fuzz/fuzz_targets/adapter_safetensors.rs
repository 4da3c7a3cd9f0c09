//! `cargo fuzz run adapter_safetensors`: [`mmlora::fuzzing::adapter_safetensors`] on the fuzzer's
//! bytes.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mmlora::fuzzing::adapter_safetensors(data));
