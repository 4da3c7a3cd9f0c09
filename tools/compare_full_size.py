"""Compares `mmlora encode --with-tower --out` of a full-size tower written by
tools/make_full_size.py with transformers run on the same folder (its bf16 weights upcast to
f32, transformers 5's default image processor, torchvision's, with the folder's settings, as
`mmlora encode` runs by default): prints the relative Frobenius error of the embeddings (and of
the deepstack outputs, for Qwen3-VL).

    .venv/bin/python tools/compare_full_size.py qwen3-vl-2b FOLDER IMAGE OUT.safetensors
"""

import sys
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import load_file
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_full_size import MODELS, tower  # noqa: E402


def relative(actual, expected):
    return float((actual - expected).norm() / expected.norm())


def main():
    name, folder, image, written = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    visual = tower(name)
    prefix = "model.visual."
    state = {}
    for shard in folder.glob("model-*.safetensors"):
        state.update({k[len(prefix):]: v.float() for k, v in load_file(shard).items()})
    visual.load_state_dict(state)
    settings = {k: v for k, v in MODELS[name][6].items() if k != "image_processor_type"}
    batch = Qwen2VLImageProcessor(**settings)(images=[Image.open(image)], return_tensors="pt")
    with torch.no_grad():
        out = visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"])
    got = load_file(written)
    print(f"{name}: grid {batch['image_grid_thw'].tolist()}, embeddings rel. "
          f"{relative(got[f'{image.name}.embeds'], out.pooler_output):.3g}")
    if getattr(out, "deepstack_features", None):
        deepstack = torch.cat(out.deepstack_features, dim=1)
        print(f"{name}: deepstack rel. {relative(got[f'{image.name}.deepstack'], deepstack):.3g}")


if __name__ == "__main__":
    main()
