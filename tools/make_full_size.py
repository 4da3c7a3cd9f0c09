"""Writes a full-size vision tower with random weights in a released checkpoint's layout, for
the manual load test in BENCHMARKS.md ("Full-size towers"): transformers' tower of the family
(its released `vision_config`), bf16 on disk under `model.visual.`, sharded with an index as
the hub ships it, the released `config.json` shape and the family's processor settings.

    .venv/bin/python tools/make_full_size.py qwen2.5-vl-3b /tmp/full/qwen2.5-vl-3b
    mmlora encode --device cpu --model /tmp/full/qwen2.5-vl-3b IMAGE_448.png

Families: qwen2.5-vl-3b, qwen3-vl-2b. Nothing is fetched; the weights are transformers' own
random initialisation with a fixed seed.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

# name -> (config class, model class, model_type, architecture, released vision_config,
# language model width, processor settings as the hub's preprocessor_config.json has them)
MODELS = {
    "qwen2.5-vl-3b": (
        Qwen2_5_VLVisionConfig,
        Qwen2_5_VisionTransformerPretrainedModel,
        "qwen2_5_vl",
        "Qwen2_5_VLForConditionalGeneration",
        dict(
            depth=32, hidden_act="silu", hidden_size=1280, intermediate_size=3420, num_heads=16,
            in_chans=3, out_hidden_size=2048, patch_size=14, spatial_merge_size=2,
            spatial_patch_size=14, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
            tokens_per_second=2, temporal_patch_size=2,
        ),
        2048,
        dict(
            min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2,
            merge_size=2, image_mean=[0.48145466, 0.4578275, 0.40821073],
            image_std=[0.26862954, 0.26130258, 0.27577711],
            image_processor_type="Qwen2VLImageProcessor",
        ),
    ),
    "qwen3-vl-2b": (
        Qwen3VLVisionConfig,
        Qwen3VLVisionModel,
        "qwen3_vl",
        "Qwen3VLForConditionalGeneration",
        dict(
            deepstack_visual_indexes=[5, 11, 17], depth=24, hidden_act="gelu_pytorch_tanh",
            hidden_size=1024, in_channels=3, initializer_range=0.02, intermediate_size=4096,
            num_heads=16, num_position_embeddings=2304, out_hidden_size=2048, patch_size=16,
            spatial_merge_size=2, temporal_patch_size=2,
        ),
        2048,
        dict(
            size={"longest_edge": 16777216, "shortest_edge": 65536}, patch_size=16,
            temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5], image_processor_type="Qwen2VLImageProcessorFast",
        ),
    ),
}

# Bytes per shard, at most: the hub's shards hold a few GB each; this splits the tower in two.
SHARD_BYTES = 512 << 20


def tower(name):
    """transformers' tower of `name`'s released vision config (random weights, f32)."""
    config_class, model_class, _, _, vision, _, _ = MODELS[name]
    fields = dict(vision)
    if "in_chans" in fields:
        fields["in_channels"] = fields.pop("in_chans")
    fields.pop("spatial_patch_size", None)
    fields.pop("tokens_per_second", None)
    config = config_class(**fields)
    config._attn_implementation = "sdpa"
    return model_class(config).eval()


def main():
    name, out = sys.argv[1], Path(sys.argv[2])
    _, _, model_type, architecture, vision, lm_hidden, processor = MODELS[name]
    torch.manual_seed(0)
    visual = tower(name).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    state = {f"model.visual.{k}": v.contiguous() for k, v in visual.state_dict().items()}
    shards, current, size = [], {}, 0
    for key, value in state.items():
        if current and size + value.numel() * 2 > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[key] = value
        size += value.numel() * 2
    shards.append(current)
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, out / file, metadata={"format": "pt"})
        weight_map.update({key: file for key in tensors})
    total = sum(v.numel() * 2 for v in state.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    hub = {"architectures": [architecture], "model_type": model_type, "torch_dtype": "bfloat16"}
    if model_type == "qwen3_vl":
        hub["text_config"] = {"hidden_size": lm_hidden, "model_type": "qwen3_vl_text"}
        hub["vision_config"] = dict(vision, model_type=model_type)
    else:
        hub["hidden_size"] = lm_hidden
        hub["vision_config"] = vision
    (out / "config.json").write_text(json.dumps(hub, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    print(f"{name}: {sum(v.numel() for v in state.values())} parameters, {total} bytes in "
          f"{len(shards)} shards, under {out}")


if __name__ == "__main__":
    main()
