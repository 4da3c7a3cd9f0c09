#!/usr/bin/env bash
# The H200 check, in one device call, right after `bash tools/h200/prepare.sh` here (it packs the
# binaries of the commit checked out; this script prints which):
#   run(command="bash tools/h200/run.sh", carry=[".gl", ".device"], timeout_s=480)
# That leaves a few minutes of the session's 15 for one more call, which can name the steps the
# first had no time for: MMLORA_RUN_STEPS="linear-tests op-tests" bash tools/h200/run.sh
# Rehearse it here first, on lavapipe with the tiny preset (the same unpacking, steps and flags,
# small shapes, each step's limit four times as long, no cooperative matrices: the coop steps fail
# there):
#   OUT=/tmp/rehearsal MMLORA_RUN_BUDGET_S=3000 bash tools/h200/run.sh --rehearse
#
# The device call is killed at its limit, so every step runs under one budget
# ($MMLORA_RUN_BUDGET_S, 420 s from the start of this script): a step gets the smaller of its own
# limit and what is left of the budget, and a step with under 15 s left is skipped. The steps
# run most-wanted first: the issue's numbers, then the checks on a real driver. Each step's
# standard output (JSON lines for the benches) and log go into $OUT/results.tar as NAME.out and
# NAME.log as soon as it ends (the device tool returns at most 8 files); $OUT/steps.tsv has each
# step's exit status and seconds, to plan the next run with. The benches print each line as soon
# as it is measured, so a step stopped at its limit keeps what it had.
set -uo pipefail
rehearse=false
[[ ${1:-} == --rehearse ]] && rehearse=true
OUT=${OUT:?OUT names the folder for the results}
mkdir -p "$OUT"
rm -f "$OUT/results.tar"
deadline=$(( $(date +%s) + ${MMLORA_RUN_BUDGET_S:-420} ))

export XDG_RUNTIME_DIR=/tmp CI=true WGPU_BACKEND=vulkan
if $rehearse; then
    shape=(--preset tiny --side 56)
    torch_device=cpu
    linear_rows=256
    attention_images=1
    expect_coop=0
    slower=4
else
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
    # The test binaries find the fixtures under the path they were built in.
    mkdir -p /work && ln -sfn "$PWD" /work/main
    shape=(--side 448)
    torch_device=cuda
    linear_rows=8192
    attention_images=8
    expect_coop=1
    slower=1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
fi
echo "binaries of: $(cat .device/commit 2>/dev/null || echo 'an unknown commit')"
bin=$(mktemp -d)
work=$(mktemp -d)
python3 - "$bin" <<'PY'
import sys, tarfile
with tarfile.open(".device/binaries.tar.xz", "r:xz") as packed:
    packed.extractall(sys.argv[1], filter="tar")
PY

# step NAME LIMIT COMMAND...: runs COMMAND under the smaller of LIMIT and the budget left.
step() {
    local name=$1 limit=$(( $2 * slower )) left start rc
    shift 2
    # $MMLORA_RUN_STEPS (names separated by spaces), when set, picks the steps to run: a second
    # call runs those the first had no time for.
    if [[ -n ${MMLORA_RUN_STEPS:-} && " $MMLORA_RUN_STEPS " != *" $name "* ]]; then
        return
    fi
    left=$(( deadline - $(date +%s) ))
    if (( left < 15 )); then
        echo "== $name: skipped, ${left} s of the budget left"
        printf '%s\tskipped\t0\n' "$name" >> "$OUT/steps.tsv"
        return
    fi
    (( limit > left )) && limit=$left
    echo "== $name (at most $limit s)"
    start=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$work/$name.out" 2> "$work/$name.log"
    rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - start )) s"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" >> "$OUT/steps.tsv"
    # Into the archive at once (with anything else the step wrote, such as the plot).
    (cd "$work" && tar -rf "$OUT/results.tar" -- * && rm -f -- *)
}
# The bench on the GPU at the issue's 8 images of 448² (tiny ones in a rehearsal).
bench=("$bin/mmlora" bench --device gpu --json --images 8 "${shape[@]}")
: > "$OUT/steps.tsv"

step devices 30 "$bin/mmlora" devices
# The issue's numbers: 8 images, 1-8 mixed adapters at ranks 8, 16 and 64, against the base; the
# op alone at 256, 4096 and 8192 rows against the base linear; Burn's matmul for the linears. The
# fused attention kernel (the default) runs every configuration, and the base runs once more
# with Burn's attention beside it.
step bench 180 "${bench[@]}" --adapters 1,2,4,8 --ranks 8,16,64 --op-rows 256,4096,8192 \
    --kernels linear=burn --plot "$work/bench.png"
step bench-f16 120 "${bench[@]}" --adapters 1,8 --ranks 16 --op-rows 256,4096 --precision f16 \
    --kernels linear=burn
# The PyTorch + PEFT baseline on the same machine, the same shapes and adapters (CUDA's fp32
# without TF32, and bf16: the issue's anchors), with the image's PyTorch and transformers.
torch_bench=(python3 tools/bench_torch.py --device "$torch_device" --images 8 "${shape[@]}"
    --adapters 1,2,4,8 --ranks 16)
step torch-fp32 120 "${torch_bench[@]}"
step torch-bf16 90 "${torch_bench[@]}" --dtype bfloat16
# The fastest linear kernel per shape (`timed` times Burn's and our tiled one, hardware-checked
# or not, each against Burn's first, its picks logged at info), and the base with each kernel
# alone beside it. The op lines time the op apart and fused into the picked kernel side by side (`fused_*`), with the
# adapters mixed row by row (the fused store's worst case) and in runs of rows (as images).
step linear-kernels 120 env RUST_LOG=mmlora=info \
    "${bench[@]}" --adapters 8 --ranks 16 --op-rows 256,4096,8192 --op-mix rows,runs --repeats 2 \
    --kernels linear=timed
# The f16 linears on cooperative matrices (the tensor cores).
step coop-f16 90 "${bench[@]}" --adapters 1,8 --ranks 16 --op-rows 256,4096 --precision f16 \
    --kernels linear=coop
# Where the time goes: each stage clocked (products in TFLOP/s, against the fp32 ALU peak of ~67
# and cuBLAS's 50.3), with the linears timed per shape, auto's LoRA shrink (`split` or `wide`
# per shape, timed, once hardware-checked) and auto's fusion of the op (fused or apart per
# shape, timed); the picks logged at info.
step stages 90 env RUST_LOG=mmlora=info \
    "${bench[@]}" --stages --adapters 8 --ranks 16 --repeats 2 --kernels linear=timed
# The same with the wide LoRA kernels on every shape, against the step above's picks.
step stages-wide 90 env RUST_LOG=mmlora=info \
    "${bench[@]}" --stages --adapters 8 --ranks 16 --repeats 2 \
    --kernels linear=timed,shrink=wide
# 16 distinct adapters need 16 images (each image carries one).
step bench-16 90 "$bin/mmlora" bench --device gpu --json --images 16 "${shape[@]}" \
    --adapters 16 --ranks 16 --no-op --kernels linear=burn
# The op against the native path on a real Vulkan driver, every shader and edge case, and fused
# into the linear kernels (the real coop ones too: MMLORA_EXPECT_COOP=1 fails where they cannot
# run).
step op-tests 120 env MMLORA_EXPECT_COOP=$expect_coop "$bin/lib" ops::lora
# The fused attention, rotary and layer norm kernels (and Burn's attention and norm) against
# float64 on a real driver, f32 and f16.
step fused-tests 60 "$bin/lib" ops::attention ops::attention::wgsl ops::rotary \
    ops::norm ops::norm::wgsl
# Attention alone, Burn's against the fused kernel, over 8 images of 448² (criterion; FLOP/s).
step attention-alone 60 env MMLORA_BENCH_IMAGES=$attention_images "$bin/attention_bench" --bench \
    --warm-up-time 0.5 --measurement-time 1
# The linear kernels against float64, each coop product 50 times with every output checked, so
# that a slice read from workgroup memory before its stores reach it (naga writes no
# availability or visibility for them: wgpu issue #8805) would show. MMLORA_EXPECT_COOP=1
# fails the coop tests where the adapter has no cooperative matrices, rather than skipping them.
step linear-tests 120 env MMLORA_EXPECT_COOP=$expect_coop MMLORA_COOP_REPEATS=50 \
    "$bin/lib" ops::linear --nocapture
step linear-kernels-f16 120 env RUST_LOG=mmlora=info \
    "${bench[@]}" --adapters 8 --ranks 16 --op-rows 256,4096,8192 --op-mix rows,runs --repeats 2 \
    --kernels linear=timed --precision f16
step stages-f16 90 env RUST_LOG=mmlora=info \
    "${bench[@]}" --stages --adapters 8 --ranks 16 --repeats 2 --kernels linear=timed \
    --precision f16
# The engine against transformers + PEFT, isolation and the rest, on a real driver.
step engine-tests 180 "$bin/engine" --skip every_other_graphics_api
# How time and memory grow with images per batch and adapters loaded past 16 slots (after the
# tests: on 2026-12-04 its 150 s left them no time).
step scale 150 "$bin/mmlora" bench --device gpu --json --scale "${shape[@]}" \
    --scale-images 1,4,16,64 --scale-adapters 1,16,64 --kernels linear=burn
# auto's timing per shape, on sizes up to 4 GiB, each pick checked first.
step linear-choice-tests 90 env MMLORA_EXPECT_COOP=$expect_coop \
    "$bin/lib" ops::linear::choice --nocapture
# Each linear alone in every kernel and precision (criterion; FLOP/s): 6 shapes, each in 2
# kernels in f32 and 5 in f16.
step linears-alone 120 env MMLORA_BENCH_ROWS=$linear_rows "$bin/linear_bench" --bench \
    --warm-up-time 0.5 --measurement-time 1
# The op with the shrink shader built for software GPUs (compare with the bench step's op lines).
step shrink-registers 60 "${bench[@]}" --adapters 8 --ranks 16,64 --op-rows 256,4096 \
    --kernels linear=burn,shrink=registers
step soak 120 env MMLORA_SOAK_BATCHES=200 "$bin/soak" on_wgpu --nocapture
step device-faults 120 "$bin/device_faults"
# The fixture batch on NVIDIA's OpenGL ES (EGL) too; last and on a short clock, since wgpu's GL
# backend can hang on a slow compile (BENCHMARKS.md).
step engine-on-gl 60 env MMLORA_GRAPHICS_APIS=vulkan,gl "$bin/engine" every_other_graphics_api \
    --nocapture

# The gist on standard output too, should the files not come back: the main lines' key fields.
cat "$OUT/steps.tsv"
python3 - "$OUT/results.tar" <<'PY'
import json, sys, tarfile
keys = ["kind", "adapters", "rank", "rows", "op_mix", "precision", "linear_kernel", "lora_shrink", "attention_kernel",
        "median_ms", "img_per_s",
        "ratio_vs_base", "base_ms", "lora_ms", "naive_ms", "lora_overhead",
        "narrow_lora_ms", "narrow_lora_overhead", "base_back_to_back_ms",
        "lora_back_to_back_overhead", "narrow_lora_back_to_back_overhead", "fused",
        "fused_back_to_back_ms", "fused_back_to_back_overhead"]

def step_lines(results, file_name):
    """The lines of a step's file in the archive, or None where the step left none."""
    try:
        return results.extractfile(file_name).read().decode().splitlines()
    except KeyError:
        return None

with tarfile.open(sys.argv[1]) as results:
    for name in ["bench", "bench-f16", "torch-fp32", "torch-bf16", "linear-kernels", "coop-f16",
                 "linear-kernels-f16"]:
        lines = step_lines(results, f"{name}.out")
        if lines is None:
            continue
        print(f"== {name}")
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            print(" ".join(f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}"
                           for k in keys if k in record))
    # What auto's timing picked, per shape: the linears' kernels, the LoRA shrink, and whether
    # the op runs fused.
    for name in ["stages", "stages-f16"]:
        lines = step_lines(results, f"{name}.log")
        if lines is None:
            continue
        print(f"== {name} picks")
        for line in lines:
            if "kernels timed" in line or "timed fused and apart" in line:
                print(line.split(": ", 1)[-1][:240])
PY
