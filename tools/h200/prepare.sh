#!/usr/bin/env bash
# Builds, here, everything the H200 check runs and packs it into .device/ (git-ignored), to be
# carried with `.gl` (the Vulkan loader, fetched here too) and run there with
# `bash tools/h200/run.sh`. The device has no Rust toolchain; binaries are stripped and
# xz-compressed to stay under the 64 MiB the working tree may carry.
set -euo pipefail
cd "$(dirname "$0")/../.."

# The Vulkan and EGL loaders the device lacks (the device tool's README), fetched once: Vulkan
# for the run, EGL for the engine test on NVIDIA's OpenGL ES.
mkdir -p .gl
missing=()
for package in libvulkan1 libegl1 libglvnd0; do
    compgen -G ".gl/${package}_*.deb" > /dev/null || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
    mkdir -p /tmp/amd64/partial
    apt_opts=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64)
    apt-get "${apt_opts[@]}" update -qq
    (cd .gl && apt-get "${apt_opts[@]}" download "${missing[@]}")
fi

# The tests find their fixtures under the folder they were compiled in (`CARGO_MANIFEST_DIR`),
# and cargo keeps binaries compiled from another clone sharing this target folder (CI's in
# /tmp/ci, say) as fresh: touching the crate's root has them compiled here, under the path that
# run.sh links on the device.
touch src/lib.rs
cargo build --release
# name=path of each test binary the check runs (the library's unit tests hold the op tests),
# and of the benches that time the linears and attention alone in every kernel and precision
# (their FLOP/s).
{
    cargo test --release --no-run --message-format=json
    cargo bench --no-run --bench linear --bench attention --message-format=json
} 2>/dev/null | python3 -c '
import json, sys
wanted = {
    ("lib", "mmlora"): "lib",
    ("test", "engine"): "engine",
    ("test", "soak"): "soak",
    ("test", "device_faults"): "device_faults",
    ("bench", "linear"): "linear_bench",
    ("bench", "attention"): "attention_bench",
}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t = m["target"]
    name = wanted.get((t["kind"][0], t["name"]))
    if name:
        print(name + "=" + m["executable"])
' > /tmp/h200-binaries.txt
echo "mmlora=target/release/mmlora" >> /tmp/h200-binaries.txt

# One xz stream over all of them, on one thread and with a dictionary larger than all of them
# together (about 400 MB stripped), so that each binary's copy of the code they share (Burn,
# cubecl, wgpu) refers back to the first: 32 MB packed, against 55 MB with `-9`'s 64 MiB
# dictionary, which no longer spans one 62–70 MB binary (2026-12-03). Unpacking takes 0.4 GB.
rm -rf .device /tmp/h200-bin && mkdir -p .device /tmp/h200-bin
while IFS='=' read -r name path; do
    strip -o "/tmp/h200-bin/$name" "$path"
done < /tmp/h200-binaries.txt
tar -C /tmp/h200-bin -cf - . | xz -T1 --lzma2=preset=9,dict=512MiB > .device/binaries.tar.xz
rm -rf /tmp/h200-bin
# Which commit the binaries are of (run.sh prints it; `-dirty`: with uncommitted changes).
echo "$(git describe --always --dirty) packed $(date -u +%FT%TZ)" > .device/commit
# The working tree travels too; all of it must stay under the device tool's 64 MiB.
carried=$(( $(git ls-files -z | xargs -0 cat | wc -c) + $(cat .device/* .gl/* | wc -c) ))
echo "carried: $(( carried / 1024 / 1024 )) MiB of 64"
if (( carried >= 64 * 1024 * 1024 )); then
    echo "over the 64 MiB the device tool carries: drop a binary or compress harder" >&2
    exit 1
fi
