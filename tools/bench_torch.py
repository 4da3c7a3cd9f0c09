"""The PyTorch + PEFT baseline for `mmlora bench`: the same preset, images, adapters and ranks.

Runs transformers' vision tower and mergers of the preset's family (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL; random weights, eager PyTorch, SDPA attention) with PEFT LoRA adapters on every target
linear (Qwen2-VL's attn.qkv, attn.proj, mlp.fc1, mlp.fc2, merger mlp.0 and mlp.2; the same kinds
in the other families), in the configurations `mmlora bench` times: base, then K distinct adapters mixed over
the images. PEFT has no per-row adapter for a vision tower, so K adapters run as PEFT users must
run them: one forward per adapter group (`set_adapter`, then that group's images). Each timed
call starts from patches in host memory and ends with the embeddings read back to it, as
`mmlora bench`'s calls do (on the CPU both are no-ops). Warm-up
first, then the configurations take turns for `--repeats` rounds, each round led by the next
configuration; the median of each, and the median of its rounds' ratios to the base, are
printed as one JSON object per line with the fields `mmlora bench --json` prints.

    python tools/bench_torch.py --preset qwen2-vl-2b --images 8 --side 224 --adapters 1,8 --ranks 16

Pinned environment: tools/requirements.txt.
"""

import argparse
import json
import os
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

QWEN2_VL = (
    Qwen2VLVisionConfig,
    Qwen2VisionTransformerPretrainedModel,
    dict(hidden_act="quick_gelu", mlp_ratio=4, patch_size=14),
    ["attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2", "mlp.0", "mlp.2"],
)
QWEN2_5_VL = (
    Qwen2_5_VLVisionConfig,
    Qwen2_5_VisionTransformerPretrainedModel,
    dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
        window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
    ),
    ["attn.qkv", "attn.proj", "gate_proj", "up_proj", "down_proj", "mlp.0", "mlp.2"],
)
QWEN3_VL = (
    Qwen3VLVisionConfig,
    Qwen3VLVisionModel,
    dict(num_heads=16, patch_size=16, num_position_embeddings=2304),
    ["attn.qkv", "attn.proj", "linear_fc1", "linear_fc2"],  # the mergers' too
)
# As `mmlora bench --preset` names them: (family, the preset's own config fields).
PRESETS = {
    "tiny": (QWEN2_VL, dict(depth=2, embed_dim=32, num_heads=2, hidden_size=48)),
    "qwen2-vl-2b": (QWEN2_VL, dict(depth=32, embed_dim=1280, num_heads=16, hidden_size=1536)),
    "qwen2.5-vl-3b": (QWEN2_5_VL, dict(out_hidden_size=2048)),
    "qwen2.5-vl-7b": (QWEN2_5_VL, dict(out_hidden_size=3584)),
    "qwen3-vl-2b": (
        QWEN3_VL,
        dict(depth=24, hidden_size=1024, intermediate_size=4096, out_hidden_size=2048,
             deepstack_visual_indexes=[5, 11, 17]),
    ),
    "qwen3-vl-8b": (
        QWEN3_VL,
        dict(depth=27, hidden_size=1152, intermediate_size=4304, out_hidden_size=4096,
             deepstack_visual_indexes=[8, 16, 24]),
    ),
}
MERGE, TEMPORAL = 2, 2
# The pixel bounds `mmlora bench` resizes with (Qwen2-VL's processor defaults).
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280


def smart_resize(height, width, factor):
    """Qwen2-VL's smart_resize (the same as mmlora's)."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > MAX_PIXELS:
        beta = ((height * width) / MAX_PIXELS) ** 0.5
        h_bar = max(factor, int(height / beta / factor) * factor)
        w_bar = max(factor, int(width / beta / factor) * factor)
    elif h_bar * w_bar < MIN_PIXELS:
        beta = (MIN_PIXELS / (height * width)) ** 0.5
        h_bar = -(-int(height * beta) // factor) * factor
        w_bar = -(-int(width * beta) // factor) * factor
    return h_bar, w_bar


class Holder(torch.nn.Module):
    """Gives the tower transformers' key layout, `model.visual.*`, as in a VLM checkpoint."""

    def __init__(self, visual):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.visual = visual


def build(preset, device, dtype):
    (config_class, model_class, family, _), own = PRESETS[preset]
    config = config_class(
        **family, **own, in_channels=3, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL
    )
    config._attn_implementation = "sdpa"
    visual = model_class(config).eval()
    return Holder(visual).to(device=device, dtype=dtype)


def add_adapters(holder, count, rank, targets):
    """`count` distinct random adapters of rank `rank` on every target; returns their names."""
    names = [f"adapter{i}" for i in range(count)]
    model = None
    for name in names:
        lora = LoraConfig(
            r=rank,
            lora_alpha=rank,
            lora_dropout=0.0,
            target_modules=targets,
            init_lora_weights=False,  # random A and B: every adapter changes the output
        )
        if model is None:
            model = get_peft_model(holder, lora, adapter_name=name)
        else:
            model.add_adapter(name, lora)
    return model, names


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=PRESETS, default="qwen2-vl-2b")
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--side", type=int, default=224)
    parser.add_argument("--adapters", default="1,8", help="comma-separated adapter counts")
    parser.add_argument("--ranks", default="16", help="comma-separated ranks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    (_, _, family, targets), _ = PRESETS[args.preset]
    patch = family["patch_size"]
    height, width = smart_resize(args.side, args.side, patch * MERGE)
    grid = [1, height // patch, width // patch]
    rows = grid[0] * grid[1] * grid[2]
    patch_len = 3 * TEMPORAL * patch * patch
    pixels = [torch.rand(rows, patch_len, dtype=dtype) * 2 - 1 for _ in range(args.images)]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def read_back(output):
        """The merged embeddings (and Qwen3-VL's deepstack mergers' outputs, side by side)
        copied to host memory, as `mmlora bench` reads them (transformers 5 returns them as
        `pooler_output`, 4 alone)."""
        deepstack = getattr(output, "deepstack_features", None)
        if deepstack:
            torch.cat(deepstack, dim=1).cpu()
        return getattr(output, "pooler_output", output).cpu()

    def run(visual, groups):
        """One forward per (adapter, images) group, from host patches to host outputs."""
        with torch.no_grad():
            for set_active, images in groups:
                set_active()
                x = torch.cat([pixels[i] for i in images]).to(device)
                read_back(visual(x, grid_thw=torch.tensor([grid] * len(images), device=device)))
        sync()

    configs = []  # (adapters, rank, callable)
    base = build(args.preset, device, dtype)
    configs.append((0, 0, lambda: run(base.model.visual, [(lambda: None, range(args.images))])))
    for rank in [int(r) for r in args.ranks.split(",")]:
        for count in [int(k) for k in args.adapters.split(",")]:
            model, names = add_adapters(build(args.preset, device, dtype), count, rank, targets)
            visual = model.base_model.model.model.visual
            groups = [
                (lambda n=name, m=model: m.set_adapter(n), [i for i in range(args.images) if i % count == k])
                for k, name in enumerate(names)
            ]
            groups = [g for g in groups if g[1]]
            configs.append((count, rank, lambda v=visual, g=groups: run(v, g)))

    for _, _, call in configs:  # warm-up
        call()
    # Round r starts with configuration r (mod their count), as in `mmlora bench`.
    times = [[] for _ in configs]
    for round_ in range(max(args.repeats, 1)):
        for turn in range(len(configs)):
            i = (round_ + turn) % len(configs)
            started = time.perf_counter()
            configs[i][2]()
            times[i].append(time.perf_counter() - started)

    name = f"torch {torch.__version__} {args.device} {args.dtype} (transformers sdpa + PEFT)"
    for (count, rank, _), samples in zip(configs, times):
        median_ms = statistics.median(samples) * 1e3
        # The median of each round's own ratio to the base, as in `mmlora bench`.
        ratio = statistics.median(b / t for b, t in zip(times[0], samples))
        print(json.dumps({
            "device": args.device,
            "adapter_name": name,
            "preset": args.preset,
            "images": args.images,
            "side": height,  # as the image processor resized it, as `mmlora bench` reports
            "adapters": count,
            "rank": rank,
            "median_ms": median_ms,
            "img_per_s": args.images / (median_ms / 1e3),
            "ratio_vs_base": ratio,
        }))


if __name__ == "__main__":
    main()
