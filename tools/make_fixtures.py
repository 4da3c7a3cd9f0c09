"""Writes the reference fixtures under assets/tiny-qwen2-vl/ with the real thing:
transformers' Qwen2-VL vision tower, PEFT adapters, and the PIL image processor.

    python3 -m venv .venv && .venv/bin/pip install -r tools/requirements.txt
    .venv/bin/python tools/make_fixtures.py

Everything is built from configs with fixed seeds; nothing is fetched from a hub.
The model folder doubles as mmlora's embedded default model (random weights).
"""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

ROOT = Path(__file__).resolve().parent.parent / "assets" / "tiny-qwen2-vl"

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
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("ln_q.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=generator))
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


def main():
    if ROOT.exists():
        shutil.rmtree(ROOT)
    ROOT.mkdir(parents=True)
    generator = torch.Generator().manual_seed(1234)

    config = Qwen2VLVisionConfig(**VISION)
    config._attn_implementation = "eager"
    visual = Qwen2VisionTransformerPretrainedModel(config).eval()
    seeded_weights(visual, generator)
    holder = Holder(visual)

    # The checkpoint, sharded: blocks in one file, the rest (and one language-model tensor
    # mmlora must not load) in the other.
    state = {f"model.visual.{k}": v.contiguous() for k, v in visual.state_dict().items()}
    state["model.language_model.embed_tokens.weight"] = torch.zeros(4, VISION["hidden_size"])
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for key, value in state.items():
        shard = "model-00001-of-00002.safetensors" if ".blocks." in key else "model-00002-of-00002.safetensors"
        shards[shard][key] = value
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, ROOT / shard, metadata={"format": "pt"})
        weight_map.update({key: shard for key in tensors})
    total = sum(v.numel() * v.element_size() for v in state.values())
    (ROOT / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    hub_vision = dict(VISION)
    hub_vision["in_chans"] = hub_vision.pop("in_channels")  # the hub's spelling
    (ROOT / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2VLForConditionalGeneration"],
                "model_type": "qwen2_vl",
                "hidden_size": VISION["hidden_size"],
                "vision_config": hub_vision,
            },
            indent=2,
        )
    )
    processor = Qwen2VLImageProcessorPil(**PREPROCESSOR)
    processor.save_pretrained(ROOT)

    # Adapters, with seeded non-zero A and B.
    peft_model = None
    for name, kwargs in ADAPTERS.items():
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
    adapters_dir = ROOT / "adapters"
    for name in ADAPTERS:
        peft_model.save_pretrained(adapters_dir, selected_adapters=[name])
    (adapters_dir / "README.md").unlink(missing_ok=True)  # PEFT's model card template

    # Images, the processor's output, and each request's tower and connector outputs.
    write_images(ROOT / "images")
    expected = {}
    for i, (file, adapter) in enumerate(REQUESTS):
        image = Image.open(ROOT / "images" / file)
        batch = processor(images=[image], return_tensors="pt")
        pixel_values, grid = batch["pixel_values"], batch["image_grid_thw"]
        expected[f"{file}.pixel_values"] = pixel_values.contiguous()
        expected[f"{file}.image_grid_thw"] = grid.contiguous()
        with torch.no_grad():
            if adapter is None:
                with peft_model.disable_adapter():
                    out = visual(pixel_values, grid_thw=grid)
            else:
                peft_model.set_adapter(adapter)
                out = visual(pixel_values, grid_thw=grid)
        expected[f"request{i}.tower"] = out.last_hidden_state.contiguous()
        expected[f"request{i}.embeds"] = out.pooler_output.contiguous()
    # Patches of two frames (grid t = 2), as a video's would be: each frame its own attention
    # segment, the rotary table repeated per frame. Drawn after everything above, so the
    # other fixtures do not move.
    grid = torch.tensor([[2, 4, 6]])
    pixel_values = torch.randn(2 * 4 * 6, 3 * VISION["temporal_patch_size"] * 14 * 14, generator=generator)
    peft_model.set_adapter("all-r4")
    with torch.no_grad():
        out = visual(pixel_values, grid_thw=grid)
    expected["frames.pixel_values"] = pixel_values.contiguous()
    expected["frames.image_grid_thw"] = grid.contiguous()
    expected["frames.tower"] = out.last_hidden_state.contiguous()
    expected["frames.embeds"] = out.pooler_output.contiguous()
    save_file(expected, ROOT / "expected.safetensors")
    # The mixed batch in `mmlora encode --batch` form (paths relative to this file).
    batch = {
        "adapters": {name: f"adapters/{name}" for name in ADAPTERS},
        "requests": [
            {"id": f"request{i}", "image": f"images/{f}", "adapter": a}
            for i, (f, a) in enumerate(REQUESTS)
        ],
    }
    (ROOT / "batch.json").write_text(json.dumps(batch, indent=2) + "\n")


if __name__ == "__main__":
    main()
