"""Writes the reference fixtures under assets/tiny-<family>/ with the real thing:
transformers' vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), PEFT adapters, and both of
transformers' image-processor backends (torchvision, its default, and PIL); and, with Qwen2-VL,
the resize references in tests/data/ (Pillow's and torchvision's resize of one image with each
filter).

    python3 -m venv .venv && .venv/bin/pip install -r tools/requirements.txt
    .venv/bin/python tools/make_fixtures.py [qwen2-vl] [qwen2.5-vl] [qwen3-vl]

With no family named, every family is written. Everything is built from configs with fixed
seeds; nothing is fetched from a hub. Each family's draws come from its own generator, so one
family's fixtures do not move when another's change. The Qwen2-VL folder doubles as mmlora's
embedded default model (random weights).
"""

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torchvision.transforms.v2.functional as tvF
from PIL import Image
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
from transformers.vision_utils import get_vision_window_index

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TEST_DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
ROOT = ASSETS / "tiny-qwen2-vl"

VISION = dict(
    depth=2,
    embed_dim=32,
    hidden_size=48,
    hidden_act="quick_gelu",
    mlp_ratio=4,
    num_heads=2,
    in_channels=3,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
PREPROCESSOR = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 9)

# name -> (LoraConfig kwargs); B is overwritten with non-zero values below.
ADAPTERS = {
    "all-r4": dict(r=4, lora_alpha=8, target_modules=["qkv", "attn.proj", "fc1", "fc2", "mlp.0", "mlp.2"]),
    "rslora-r8": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["qkv", "fc2", "mlp.2"]),
    "tower-r2": dict(r=2, lora_alpha=2, target_modules=r".*visual\.blocks\.\d+\.(attn\.qkv|mlp\.fc1)"),
    "patterns": dict(
        r=4,
        lora_alpha=4,
        target_modules=["attn.proj", "fc1", "mlp.0"],
        rank_pattern={"fc1": 6},
        alpha_pattern={"mlp.0": 12},
    ),
}

# (file, adapter or None): the mixed batch, one request per row.
REQUESTS = [
    ("square.png", "all-r4"),
    ("wide.jpg", None),
    ("lossless.webp", "rslora-r8"),
    ("rgba.png", "tower-r2"),
    ("gray.png", "patterns"),
    ("square.png", None),
    ("progressive.jpg", "rslora-r8"),
]

ROOT_25 = ASSETS / "tiny-qwen2.5-vl"

# Four blocks, two with windows and two with full attention; windows of 56 px are 2×2 merged
# tokens, so the fixture images' grids (3×2, 4×3, … merged tokens) split into whole, partial
# and padded windows.
VISION_25 = dict(
    depth=4,
    hidden_size=32,
    hidden_act="silu",
    intermediate_size=48,
    num_heads=2,
    in_channels=3,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    tokens_per_second=2,
    window_size=56,
    out_hidden_size=40,
    fullatt_block_indexes=[1, 3],
)

# The same kinds of adapter as Qwen2-VL's, on Qwen2.5-VL's targets (its MLP is SwiGLU).
ADAPTERS_25 = {
    "all-r4": dict(
        r=4,
        lora_alpha=8,
        target_modules=["qkv", "attn.proj", "gate_proj", "up_proj", "down_proj", "mlp.0", "mlp.2"],
    ),
    "rslora-r8": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["qkv", "down_proj", "mlp.2"]),
    "tower-r2": dict(r=2, lora_alpha=2, target_modules=r".*visual\.blocks\.\d+\.(attn\.qkv|mlp\.up_proj)"),
    "patterns": dict(
        r=4,
        lora_alpha=4,
        target_modules=["attn.proj", "gate_proj", "mlp.0"],
        rank_pattern={"gate_proj": 6},
        alpha_pattern={"mlp.0": 12},
    ),
}

ROOT_3 = ASSETS / "tiny-qwen3-vl"

# Four blocks, two of them feeding deepstack mergers; a learned position table of 5×5, which
# every fixture grid (even sides, from 2 to 8 patches) needs interpolated, up or down.
VISION_3 = dict(
    depth=4,
    hidden_size=32,
    hidden_act="gelu_pytorch_tanh",
    intermediate_size=48,
    num_heads=2,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=40,
    num_position_embeddings=25,
    deepstack_visual_indexes=[1, 2],
)
# Qwen3-VL's processor settings (patch 16, mean and std 0.5, `size` in pixels), scaled down.
PREPROCESSOR_3 = dict(
    size={"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 12},
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)

# Qwen3-VL's kinds of adapter: `linear_fc1` names the blocks', the merger's and the deepstack
# mergers' first linears alike; one adapter on the deepstack mergers alone.
ADAPTERS_3 = {
    "all-r4": dict(r=4, lora_alpha=8, target_modules=["qkv", "attn.proj", "linear_fc1", "linear_fc2"]),
    "rslora-r8": dict(
        r=8, lora_alpha=4, use_rslora=True, target_modules=["qkv", "mlp.linear_fc2", "merger.linear_fc2"]
    ),
    "tower-r2": dict(r=2, lora_alpha=2, target_modules=r".*visual\.blocks\.\d+\.(attn\.qkv|mlp\.linear_fc1)"),
    "patterns": dict(
        r=4,
        lora_alpha=4,
        target_modules=["attn.proj", "linear_fc1"],
        rank_pattern={"mlp.linear_fc1": 6},
        alpha_pattern={"merger.linear_fc1": 12},
    ),
    "deepstack-r4": dict(r=4, lora_alpha=4, target_modules=r".*visual\.deepstack_merger_list\.\d+\.linear_fc[12]"),
}
# The other families' batch and a request on the deepstack adapter.
REQUESTS_3 = REQUESTS + [("wide.jpg", "deepstack-r4")]


class Holder(torch.nn.Module):
    """Gives the tower transformers' key layout: `model.visual.*`."""

    def __init__(self, visual):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.visual = visual


def seeded_weights(visual, generator):
    """Weights large enough that a wrong bias, norm or rotary visibly moves the output."""
    with torch.no_grad():
        for name, p in visual.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight", "norm.weight")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=generator))
            elif name == "pos_embed.weight":
                p.copy_(0.5 * torch.randn(p.shape, generator=generator))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(fan_in))


def write_images(images_dir):
    rng = np.random.default_rng(7)

    def smooth(h, w, channels):
        # A smooth gradient plus noise, so resizing has real work to do.
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([(x * 3 + y * 2 + 40 * c) % 256 for c in range(channels)], axis=-1)
        noise = rng.integers(0, 60, size=(h, w, channels))
        return np.clip(base + noise, 0, 255).astype(np.uint8)

    images_dir.mkdir(parents=True, exist_ok=True)
    Image.fromarray(smooth(84, 56, 3)).save(images_dir / "square.png")  # 56×84: no resize
    Image.fromarray(smooth(100, 150, 3)).save(images_dir / "wide.jpg", quality=95, subsampling=0)
    Image.fromarray(smooth(84, 84, 3)).save(images_dir / "lossless.webp", lossless=True)
    Image.fromarray(smooth(70, 90, 4), mode="RGBA").save(images_dir / "rgba.png")  # 70/28 = 2.5 → 2
    Image.fromarray(smooth(40, 50, 1)[..., 0], mode="L").save(images_dir / "gray.png")  # upscaled
    # Chroma subsampled 4:2:0 and progressive: exercises libjpeg's fancy upsampling.
    Image.fromarray(smooth(77, 123, 3)).save(
        images_dir / "progressive.jpg", quality=80, subsampling=2, progressive=True
    )


def write_checkpoint(root, visual, lm_hidden):
    """The checkpoint, sharded: blocks in one file, the rest (and one language-model tensor
    mmlora must not load) in the other, under transformers 5's `model.visual.` prefix."""
    state = {f"model.visual.{k}": v.contiguous() for k, v in visual.state_dict().items()}
    state["model.language_model.embed_tokens.weight"] = torch.zeros(4, lm_hidden)
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for key, value in state.items():
        shard = "model-00001-of-00002.safetensors" if ".blocks." in key else "model-00002-of-00002.safetensors"
        shards[shard][key] = value
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, root / shard, metadata={"format": "pt"})
        weight_map.update({key: shard for key in tensors})
    total = sum(v.numel() * v.element_size() for v in state.values())
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def write_adapters(root, holder, adapters, generator):
    """PEFT adapters on `holder`'s tower with seeded non-zero A and B, saved under
    `root/adapters/`; returns the PEFT model holding them all."""
    peft_model = None
    for name, kwargs in adapters.items():
        lora = LoraConfig(lora_dropout=0.0, bias="none", **kwargs)
        if peft_model is None:
            peft_model = get_peft_model(holder, lora, adapter_name=name)
        else:
            peft_model.add_adapter(name, lora)
    with torch.no_grad():
        for module_name, module in peft_model.named_modules():
            if hasattr(module, "lora_A"):
                for name in module.lora_A:
                    a = module.lora_A[name].weight
                    b = module.lora_B[name].weight
                    a.copy_(torch.randn(a.shape, generator=generator) / math.sqrt(a.shape[1]))
                    b.copy_(0.15 * torch.randn(b.shape, generator=generator))
    adapters_dir = root / "adapters"
    for name in adapters:
        peft_model.save_pretrained(adapters_dir, selected_adapters=[name])
    (adapters_dir / "README.md").unlink(missing_ok=True)  # PEFT's model card template
    return peft_model


def run_tower(visual, peft_model, adapter, pixel_values, grid):
    """The tower's output with `adapter` (or none)."""
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                return visual(pixel_values, grid_thw=grid)
        peft_model.set_adapter(adapter)
        return visual(pixel_values, grid_thw=grid)


def write_requests(root, processors, run, adapters, requests=REQUESTS):
    """Images, both processor backends' output and each request's outputs (`run`: `(adapter,
    pixel_values, grid)` → `{"tower": …, "embeds": …}`, and any other output the family has),
    and the mixed batch file. The outputs are run on the torchvision backend's pixels, as
    transformers 5's `AutoProcessor` gives them; `{file}.pil.pixel_values` holds the PIL
    backend's."""
    write_images(root / "images")
    expected = {}
    for i, (file, adapter) in enumerate(requests):
        image = Image.open(root / "images" / file)
        batch = processors["torchvision"](images=[image], return_tensors="pt")
        pil = processors["pil"](images=[image], return_tensors="pt")
        pixel_values, grid = batch["pixel_values"], batch["image_grid_thw"]
        assert torch.equal(grid, pil["image_grid_thw"]), file
        expected[f"{file}.pixel_values"] = pixel_values.contiguous()
        expected[f"{file}.pil.pixel_values"] = pil["pixel_values"].contiguous()
        expected[f"{file}.image_grid_thw"] = grid.contiguous()
        for output, value in run(adapter, pixel_values, grid).items():
            expected[f"request{i}.{output}"] = value.contiguous()
    # The mixed batch in `mmlora encode --batch` form (paths relative to this file).
    batch = {
        "adapters": {name: f"adapters/{name}" for name in adapters},
        "requests": [
            {"id": f"request{i}", "image": f"images/{f}", "adapter": a}
            for i, (f, a) in enumerate(requests)
        ],
    }
    (root / "batch.json").write_text(json.dumps(batch, indent=2) + "\n")
    return expected


# Pillow's filters by number, and torchvision's modes for those it has.
FILTERS = {1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
TORCHVISION_MODES = {
    "lanczos": tvF.InterpolationMode.LANCZOS,
    "bilinear": tvF.InterpolationMode.BILINEAR,
    "bicubic": tvF.InterpolationMode.BICUBIC,
}
# Both axes down; both up; the height down more than twice the width (Pillow 13 runs its
# vertical pass first); the height down while the width grows.
RESIZES = [(37, 61), (90, 130), (50, 40), (70, 60)]


def write_resize_references(image_path):
    """`image_path` resized with each filter by Pillow (`Image.resize`, as the PIL backend calls
    it) and by torchvision (`resize` on a `uint8` tensor with antialiasing, as the torchvision
    backend calls it), saved as `tests/data/square-{backend}-{filter}-{w}x{h}.png`."""
    image = Image.open(image_path).convert("RGB")
    tensor = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()
    for old in TEST_DATA.glob("square-*-*x*.png"):
        old.unlink()
    for number, name in FILTERS.items():
        for width, height in RESIZES:
            pil = image.resize((width, height), resample=number, reducing_gap=None)
            pil.save(TEST_DATA / f"square-pil-{name}-{width}x{height}.png")
            if name in TORCHVISION_MODES:
                resized = tvF.resize(tensor, [height, width], interpolation=TORCHVISION_MODES[name], antialias=True)
                Image.fromarray(resized.permute(1, 2, 0).numpy()).save(
                    TEST_DATA / f"square-torchvision-{name}-{width}x{height}.png"
                )


def write_frames(expected, generator, run, patch_len):
    """Patches of two frames (grid t = 2), as a video's would be: each frame its own attention
    segment, the rotary table repeated per frame. Drawn after everything else, so the other
    fixtures do not move."""
    grid = torch.tensor([[2, 4, 6]])
    pixel_values = torch.randn(2 * 4 * 6, patch_len, generator=generator)
    outputs = run("all-r4", pixel_values, grid)
    expected["frames.pixel_values"] = pixel_values.contiguous()
    expected["frames.image_grid_thw"] = grid.contiguous()
    for output, value in outputs.items():
        expected[f"frames.{output}"] = value.contiguous()


def start_family(
    root, seed, config_class, model_class, vision, lm_hidden, architecture, model_type, processor=PREPROCESSOR
):
    """A family's folder from scratch: its tiny tower with seeded weights, the checkpoint, a
    hub-style `config.json` (Qwen2-VL and Qwen2.5-VL: `in_chans`, and `spatial_patch_size`
    beside `patch_size` where the family's hub files carry both, the language model's width at
    the top; Qwen3-VL: transformers' names, the language model's fields under `text_config`),
    the processor's settings (`processor`) and the seeded adapters. Returns the generator (for
    draws after these), the tower, the processor's two backends and the tower's holder."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)

    config = config_class(**vision)
    config._attn_implementation = "eager"
    visual = model_class(config).eval()
    seeded_weights(visual, generator)
    holder = Holder(visual)
    write_checkpoint(root, visual, lm_hidden)
    hub_vision = dict(vision)
    hub = {"architectures": [architecture], "model_type": model_type}
    if model_type == "qwen3_vl":
        hub_vision["model_type"] = model_type  # as the released files have it
        hub["text_config"] = {"hidden_size": lm_hidden, "model_type": "qwen3_vl_text"}
    else:
        hub_vision["in_chans"] = hub_vision.pop("in_channels")  # the hub's spelling
        hub["hidden_size"] = lm_hidden
    if model_type == "qwen2_5_vl":
        hub_vision["spatial_patch_size"] = hub_vision["patch_size"]
    hub["vision_config"] = hub_vision
    (root / "config.json").write_text(json.dumps(hub, indent=2))
    processors = {
        "torchvision": Qwen2VLImageProcessor(**processor),
        "pil": Qwen2VLImageProcessorPil(**processor),
    }
    processors["torchvision"].save_pretrained(root)
    return generator, visual, processors, holder


def qwen2_vl():
    generator, visual, processors, holder = start_family(
        ROOT, 1234, Qwen2VLVisionConfig, Qwen2VisionTransformerPretrainedModel, VISION,
        VISION["hidden_size"], "Qwen2VLForConditionalGeneration", "qwen2_vl",
    )
    peft_model = write_adapters(ROOT, holder, ADAPTERS, generator)

    def run(adapter, pixel_values, grid):
        out = run_tower(visual, peft_model, adapter, pixel_values, grid)
        return {"tower": out.last_hidden_state, "embeds": out.pooler_output}

    expected = write_requests(ROOT, processors, run, ADAPTERS)
    write_resize_references(ROOT / "images" / "square.png")
    write_frames(expected, generator, run, 3 * VISION["temporal_patch_size"] * 14 * 14)
    save_file(expected, ROOT / "expected.safetensors")


def qwen2_5_vl():
    """Qwen2.5-VL: RMSNorm, SwiGLU and window attention. Its tower's `last_hidden_state` is in
    window order; the fixture puts it back in the processor's order, as mmlora returns it."""
    generator, visual, processors, holder = start_family(
        ROOT_25, 2525, Qwen2_5_VLVisionConfig, Qwen2_5_VisionTransformerPretrainedModel, VISION_25,
        VISION_25["out_hidden_size"], "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl",
    )
    peft_model = write_adapters(ROOT_25, holder, ADAPTERS_25, generator)
    merge_unit = VISION_25["spatial_merge_size"] ** 2

    def run(adapter, pixel_values, grid):
        out = run_tower(visual, peft_model, adapter, pixel_values, grid)
        window_index, _ = get_vision_window_index(
            grid, VISION_25["spatial_merge_size"], VISION_25["window_size"], VISION_25["patch_size"]
        )
        hidden = out.last_hidden_state
        rows = hidden.shape[0]
        unpermuted = hidden.reshape(rows // merge_unit, merge_unit, -1)[torch.argsort(window_index)]
        return {"tower": unpermuted.reshape(rows, -1), "embeds": out.pooler_output}

    expected = write_requests(ROOT_25, processors, run, ADAPTERS_25)
    write_frames(expected, generator, run, 3 * VISION_25["temporal_patch_size"] * 14 * 14)
    save_file(expected, ROOT_25 / "expected.safetensors")


def qwen3_vl():
    """Qwen3-VL: LayerNorm blocks with a GELU-tanh MLP, a learned position table interpolated to
    each grid, and deepstack mergers, whose outputs are concatenated along features as vLLM
    does (`deepstack`)."""
    generator, visual, processors, holder = start_family(
        ROOT_3, 3333, Qwen3VLVisionConfig, Qwen3VLVisionModel, VISION_3, VISION_3["out_hidden_size"],
        "Qwen3VLForConditionalGeneration", "qwen3_vl", PREPROCESSOR_3,
    )
    peft_model = write_adapters(ROOT_3, holder, ADAPTERS_3, generator)

    def run(adapter, pixel_values, grid):
        out = run_tower(visual, peft_model, adapter, pixel_values, grid)
        return {
            "tower": out.last_hidden_state,
            "embeds": out.pooler_output,
            "deepstack": torch.cat(out.deepstack_features, dim=1),
        }

    expected = write_requests(ROOT_3, processors, run, ADAPTERS_3, REQUESTS_3)
    write_frames(expected, generator, run, 3 * VISION_3["temporal_patch_size"] * 16 * 16)
    save_file(expected, ROOT_3 / "expected.safetensors")


FAMILIES = {"qwen2-vl": qwen2_vl, "qwen2.5-vl": qwen2_5_vl, "qwen3-vl": qwen3_vl}


def main():
    for family in sys.argv[1:] or FAMILIES:
        FAMILIES[family]()


if __name__ == "__main__":
    main()
