#!/usr/bin/env bash
# The H200 check, in one device call (at most 9 minutes there, start-up aside):
#   run(command="bash tools/h200/run.sh", carry=[".gl", ".device"], timeout_s=540)
# after `bash tools/h200/prepare.sh` here. Logs and results land in $OUT.
set -uo pipefail
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
export XDG_RUNTIME_DIR=/tmp CI=true WGPU_BACKEND=vulkan
# The binaries find the fixtures under the path they were built in.
mkdir -p /work && ln -sfn "$PWD" /work/main
python3 - <<'PY'
import tarfile
with tarfile.open(".device/binaries.tar.xz", "r:xz") as packed:
    packed.extractall("/tmp/bin", filter="tar")
PY
step() { echo "== $1" >&2; shift; timeout "$@"; echo "== exit $?" >&2; }
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    step devices 60 /tmp/bin/mmlora devices
    # Correctness on a real Vulkan driver: the op against the native path, the engine against
    # transformers + PEFT, isolation, device faults.
    step "op tests" 300 /tmp/bin/lib lora::ops
    # model::gemm holds the cooperative-matrix kernel's test (coop_matches_float64), which
    # runs only where the adapter has cooperative matrices (`devices` says whether it has);
    # MMLORA_EXPECT_COOP=1 fails the coop tests where it has not, rather than skipping them.
    # Each coop product runs 50 times, every output checked, so that a slice read from
    # workgroup memory before its stores reach it (naga writes no availability or visibility
    # for them: wgpu issue #8805) would show (estimated under 10 s: the float64 references are
    # computed once per shape).
    step "linear kernel tests" 300 env MMLORA_EXPECT_COOP=1 MMLORA_COOP_REPEATS=50 \
        /tmp/bin/lib model::gemm --nocapture
    # Timing per shape, the picks among Burn's, ours and (in f16) coop, each checked first.
    step "linear choice tests" 120 env MMLORA_EXPECT_COOP=1 /tmp/bin/lib model::linear_choice \
        --nocapture
    step "engine tests" 300 /tmp/bin/engine --skip every_other_graphics_api
    step "soak (200 batches)" 300 env MMLORA_SOAK_BATCHES=200 /tmp/bin/soak on_wgpu --nocapture
    step "device faults" 300 /tmp/bin/device_faults
    # The fixture batch on NVIDIA's OpenGL ES (EGL) too, beside the Vulkan the rest runs on; last
    # and on a short clock, since wgpu's GL backend can hang on a slow compile (BENCHMARKS.md).
    step "engine on GL" 90 env MMLORA_GRAPHICS_APIS=vulkan,gl /tmp/bin/engine \
        every_other_graphics_api --nocapture
} 2>&1 | tee "$OUT/checks.log"
# Numbers: the issue's shapes (8 images of 448², 1–8 adapters, ranks 16 and 64; the op at
# 256, 4096 and 8192 rows), the same in f16, Burn's matmul against our tiled linear kernel in
# f32 and f16 (auto times them per shape, its picks logged at info, and runs the base with
# each alone too), the f16 linears on cooperative matrices (coop: never run before, the
# tensor cores), each linear alone in every kernel and precision (FLOP/s), the op with the
# shrink shader built for software GPUs (auto takes the split one on a hardware GPU: compare
# with bench 448's op lines), where the time goes stage by stage, then how time and memory grow
# with images and adapters.
step "bench 448" 300 /tmp/bin/mmlora bench --device gpu --json --images 8 --side 448 \
    --adapters 1,2,4,8 --ranks 16,64 --op-rows 256,4096,8192 --linear-kernel burn \
    --plot "$OUT/h200-448.png" > "$OUT/bench-448.jsonl" 2> "$OUT/bench-448.log"
step "linear kernels 448" 90 env RUST_LOG=mmlora=info /tmp/bin/mmlora bench --device gpu --json --images 8 --side 448 \
    --adapters 8 --ranks 16 --no-op --repeats 2 --linear-kernel auto \
    > "$OUT/linear-448.jsonl" 2> "$OUT/linear-448.log"
step "bench 448 f16" 120 /tmp/bin/mmlora bench --device gpu --json --images 8 --side 448 \
    --adapters 1,8 --ranks 16 --op-rows 256,4096 --precision f16 --linear-kernel burn \
    > "$OUT/bench-448-f16.jsonl" 2> "$OUT/bench-448-f16.log"
step "coop linears 448 f16" 120 /tmp/bin/mmlora bench --device gpu --json --images 8 --side 448 \
    --adapters 1,8 --ranks 16 --op-rows 256,4096 --precision f16 --linear-kernel coop \
    > "$OUT/coop-448-f16.jsonl" 2> "$OUT/coop-448-f16.log"
step "linears alone 8192 rows" 100 env MMLORA_BENCH_ROWS=8192 /tmp/bin/linear_bench --bench \
    --warm-up-time 0.5 --measurement-time 1 > "$OUT/linears-8192.log" 2>&1
step "lora shrink registers" 90 /tmp/bin/mmlora bench --device gpu --json --images 8 --side 448 \
    --adapters 8 --ranks 16,64 --op-rows 256,4096 --linear-kernel burn --lora-shrink registers \
    > "$OUT/shrink-registers.jsonl" 2> "$OUT/shrink-registers.log"
step "linear kernels 448 f16" 90 env RUST_LOG=mmlora=info /tmp/bin/mmlora bench --device gpu --json --images 8 \
    --side 448 --adapters 8 --ranks 16 --no-op --repeats 2 --linear-kernel auto --precision f16 \
    > "$OUT/linear-448-f16.jsonl" 2> "$OUT/linear-448-f16.log"
# Where the time goes: each stage of the pass clocked (products in TFLOP/s, against the fp32
# ALU peak of ~67 and cuBLAS's 50.3), with auto's linears, in f32 and f16.
step "stages 448" 90 env RUST_LOG=mmlora=info /tmp/bin/mmlora bench --device gpu --json --stages \
    --images 8 --side 448 --adapters 8 --ranks 16 --repeats 2 --linear-kernel auto \
    > "$OUT/stages-448.jsonl" 2> "$OUT/stages-448.log"
step "stages 448 f16" 90 env RUST_LOG=mmlora=info /tmp/bin/mmlora bench --device gpu --json --stages \
    --images 8 --side 448 --adapters 8 --ranks 16 --repeats 2 --linear-kernel auto --precision f16 \
    > "$OUT/stages-448-f16.jsonl" 2> "$OUT/stages-448-f16.log"
step "scale 448" 150 /tmp/bin/mmlora bench --device gpu --json --scale --side 448 \
    --scale-images 1,4,16,64 --scale-adapters 1,16,64 --linear-kernel burn \
    > "$OUT/scale-448.jsonl" 2> "$OUT/scale-448.log"
tail -n 60 "$OUT"/*.jsonl
