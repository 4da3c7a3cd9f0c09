//! `cargo fuzz run mapping`: [`mmlora::fuzzing::mapping`] on the fuzzer's bytes.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mmlora::fuzzing::mapping(data));
