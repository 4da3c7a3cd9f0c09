#!/usr/bin/env bash
# Builds, here, everything the H200 check runs and packs it into .device/ (git-ignored), to be
# carried with `.gl` (the Vulkan loader, fetched here too) and run there with
# `bash tools/h200/run.sh`. The device has no Rust toolchain; binaries are stripped and
# xz-compressed to stay under the 64 MiB the working tree may carry.
set -euo pipefail
cd "$(dirname "$0")/../.."

# The Vulkan loader the device lacks (the device tool's README), fetched once.
if ! compgen -G ".gl/*.deb" > /dev/null; then
    mkdir -p .gl /tmp/amd64/partial
    apt_opts=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64)
    apt-get "${apt_opts[@]}" update -qq
    (cd .gl && apt-get "${apt_opts[@]}" download libvulkan1)
fi

cargo build --release
# name=path of each test binary the check runs (the library's unit tests hold the op tests).
cargo test --release --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
wanted = {"mmlora": "lib", "engine": "engine", "soak": "soak", "device_faults": "device_faults"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t = m["target"]
    key = "lib" if t["kind"] == ["lib"] else t["name"]
    if t["name"] in wanted and (key == "lib" or t["kind"] == ["test"]):
        print(wanted[t["name"]] + "=" + m["executable"])
' > /tmp/h200-binaries.txt
echo "mmlora=target/release/mmlora" >> /tmp/h200-binaries.txt

rm -rf .device && mkdir -p .device
while IFS='=' read -r name path; do
    strip -o "/tmp/h200-$name" "$path"
    xz -T2 -6 -c "/tmp/h200-$name" > ".device/$name.xz"
    rm "/tmp/h200-$name"
done < /tmp/h200-binaries.txt
du -ch .device/* .gl/* 2>/dev/null | tail -1
