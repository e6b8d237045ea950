"""What an image costs on its way through lilo, per image, on a vision-language base (``--model``, a tiny one by
default): at the ingress, checking it (``checked_image``: its header and a full decode, so a corrupt file is a 4xx
and not a failed step) and counting its tokens; on the trainer, turning its bytes into the vision tower's input
(``ImageLayout.pixel_inputs``: decode, resize, normalize) and the frozen vision tower's forward. Also the bytes that
travel (the JPEG as sent) against the pixels they stand for. Each figure is the median of ``--repeats``. Prints one
JSON line:
{"bench": "images", "model": .., "image_px": .., "image_tokens": .., "jpeg_bytes": .., "pixel_bytes": ..,
 "ingress_ms": .., "pixels_ms": .., "vision_ms": ..}
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from lilo.backend.models import TINY_MODELS, build_tiny, load_base_model
from lilo.backend.types import DatumImage
from lilo.backend.vision import checked_image, image_layout


def median_ms(step, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return float(np.median(times)) * 1e3


def photo_like(size: int, seed: int = 0) -> bytes:
    """A JPEG of smooth gradients and noise, compressing about as a photo does (pure noise would not)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    channels = [np.sin(6 * x + k) * np.cos(4 * y - k) for k in range(3)]
    pixels = (np.stack(channels, -1) * 100 + 128 + rng.normal(0, 8, (size, size, 3))).clip(0, 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    vision_models = [name for name in TINY_MODELS if name.endswith("-vl")]
    parser.add_argument("--model", choices=vision_models, default="tiny-qwen3-vl")
    parser.add_argument("--image-px", type=int, default=448)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    directory = build_tiny(Path(tempfile.mkdtemp()) / "model", args.model)
    layout = image_layout(directory)
    model = load_base_model(directory)
    data = photo_like(args.image_px)
    image = DatumImage(data, "jpeg", 0, None)

    def ingress() -> None:
        width, height = checked_image(data, "jpeg", "bench")
        layout.token_count(width, height)

    pixels = layout.pixel_inputs([image])
    grid = pixels["image_grid_thw"]

    def vision() -> None:
        with torch.no_grad():
            model.model.get_image_features(pixels["pixel_values"], grid, return_dict=True)

    vision()  # warm-up
    line = {"bench": "images", "model": args.model, "image_px": args.image_px,
            "image_tokens": layout.token_count(args.image_px, args.image_px), "jpeg_bytes": len(data),
            "pixel_bytes": int(pixels["pixel_values"].numel() * 4),
            "ingress_ms": round(median_ms(ingress, args.repeats), 3),
            "pixels_ms": round(median_ms(lambda: layout.pixel_inputs([image]), args.repeats), 3),
            "vision_ms": round(median_ms(vision, args.repeats), 3)}
    print(json.dumps(line))


if __name__ == "__main__":
    main()
