"""Image inputs, as Tinker takes them: an image chunk (PNG or JPEG bytes) stands for N positions of the base model's
image token, N from the image's size and the model's image processor (``preprocessor_config.json``), one token per
merge x merge patches of the image as resized: Qwen-VL's to a multiple of patch x merge pixels within its pixel
bounds (``QwenImages``), Kimi K2.5's scaled down within a patch budget and padded (``NavitImages``).

The ingress checks each image (``checked_image``: format, size, a decompression bomb, whether it decodes) and lays
it out (``ImageLayout.lay_out``); the bytes travel to the trainer as sent (a JPEG is far smaller than its pixels),
which turns them into the vision tower's input (``ImageLayout.pixel_inputs``)."""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
import json
import math
from pathlib import Path
from typing import Any, Sequence

from lilo.backend.types import DatumImage
from lilo.errors import InvalidRequestError

MAX_IMAGE_BYTES = 2 * 2**20  # Tinker's docs: 2 MB an image at most
# Past this many pixels a small file is a decompression bomb (a 2 MB PNG of one colour can claim billions).
MAX_IMAGE_PIXELS = 40_000_000
MAGIC = {"png": (b"\x89PNG\r\n\x1a\n",), "jpeg": (b"\xff\xd8\xff",)}
# Where an image's positions sit in a datum's tokens until the base model's image token is known (the route does).
PENDING = -1


def checked_image(data: bytes, format: str, where: str) -> tuple[int, int]:
    """(width, height) of an image chunk's bytes, refused with a sentence saying what to change where it is not a
    whole PNG or JPEG of at most ``MAX_IMAGE_BYTES`` and ``MAX_IMAGE_PIXELS``. ``where``: "Datum 2, chunk 1"."""
    from PIL import Image, UnidentifiedImageError

    if format not in MAGIC:
        raise InvalidRequestError(f"{where}: image format {format!r} is not supported; send png or jpeg.")
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(f"{where}: the image is {len(data):,} bytes, over the {MAX_IMAGE_BYTES:,} an image "
                                  "may be; send it smaller (re-encode as JPEG, or downscale).")
    if not data.startswith(MAGIC[format]):
        raise InvalidRequestError(f"{where}: the image's bytes are not a {format.upper()} file; send the file's "
                                  "bytes and its format (png or jpeg).")
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise InvalidRequestError(f"{where}: the image claims {width} x {height} pixels, over the "
                                          f"{MAX_IMAGE_PIXELS:,} lilo decodes; downscale it.")
            image.load()  # a truncated or corrupt file fails here, not on the trainer
    except Image.DecompressionBombError:  # PIL's own bound, past ours: the same answer
        raise InvalidRequestError(f"{where}: the image claims more pixels than the {MAX_IMAGE_PIXELS:,} lilo "
                                  "decodes; downscale it.") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise InvalidRequestError(f"{where}: the image does not decode ({error}); send a whole {format} file.") \
            from None
    return width, height


@dataclasses.dataclass(frozen=True)
class ImageLayout:
    """How a vision-language base model takes images: its image token, and its image processor's patches
    (``patch_size`` pixels a side, ``merge_size`` x ``merge_size`` of them a token) of the image as its processor
    resizes it (``resized``: a subclass's). Plain numbers, so the ingress counts tokens without transformers;
    ``pixel_inputs`` (the trainer's) makes the vision tower's input."""

    image_token_id: int
    patch_size: int
    merge_size: int
    directory: str

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of the image as the vision tower sees it: each side a multiple of patch x merge."""
        raise NotImplementedError

    def token_count(self, width: int, height: int) -> int:
        """The positions an image of ``width`` x ``height`` fills: one per merge x merge patches after the resize."""
        side_w, side_h = self.resized(width, height)
        return (side_w // self.patch_size) * (side_h // self.patch_size) // self.merge_size**2

    def lay_out(self, tokens: Sequence[int], images: Sequence[DatumImage], where: str,
                ) -> tuple[list[int], tuple[DatumImage, ...]]:
        """``tokens`` with each image's positions (``PENDING``, or none where the client did not say how many) as
        this model's image token, N of them, and the images with their offsets and counts; refused where the
        client's count is not N, naming both."""
        laid: list[int] = []
        placed = []
        taken = 0
        for number, image in enumerate(images):
            laid.extend(tokens[taken:image.offset])
            taken = image.offset + (image.tokens or 0)
            width, height = checked_image(image.data, image.format, f"{where}, image {number}")
            count = self.token_count(width, height)
            if image.tokens is not None and image.tokens != count:
                raise InvalidRequestError(
                    f"{where}, image {number}: expected_tokens is {image.tokens}, but a {width} x {height} image is "
                    f"{count} tokens for this base model; send expected_tokens={count} (the cookbook's "
                    "image_to_chunk computes it from the model's image processor) or leave it out.")
            placed.append(dataclasses.replace(image, offset=len(laid), tokens=count))
            laid.extend([self.image_token_id] * count)
        laid.extend(tokens[taken:])
        return laid, tuple(placed)

    def pixel_inputs(self, images: Sequence[DatumImage]) -> dict[str, Any]:
        """The vision tower's input for ``images``, in order: ``pixel_values`` and ``image_grid_thw``."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class QwenImages(ImageLayout):
    """Qwen-VL's images (Qwen2.5-VL, Qwen3-VL, Qwen3.5): resized to a multiple of patch x merge within
    ``min_pixels`` and ``max_pixels``; the pixels from the model's own processor in ``directory``."""

    min_pixels: int = 0
    max_pixels: int = 0

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """Each side a multiple of patch x merge, the area within the pixel bounds, the aspect ratio kept as near as
        that allows."""
        factor = self.patch_size * self.merge_size
        if max(width, height) > 200 * min(width, height):
            raise InvalidRequestError(f"An image of {width} x {height} is too narrow; its sides may differ by 200 "
                                      "times at most.")
        side_w, side_h = round(width / factor) * factor, round(height / factor) * factor
        if side_w * side_h > self.max_pixels:
            scale = math.sqrt(width * height / self.max_pixels)
            side_w = max(factor, math.floor(width / scale / factor) * factor)
            side_h = max(factor, math.floor(height / scale / factor) * factor)
        elif side_w * side_h < self.min_pixels:
            scale = math.sqrt(self.min_pixels / (width * height))
            side_w = math.ceil(width * scale / factor) * factor
            side_h = math.ceil(height * scale / factor) * factor
        return side_w, side_h

    def pixel_inputs(self, images: Sequence[DatumImage]) -> dict[str, Any]:
        return dict(_processor(self.directory)(images=_decoded(images), return_tensors="pt"))


@dataclasses.dataclass(frozen=True)
class NavitImages(ImageLayout):
    """Kimi K2.5 / K2.6's images (MoonViT's NaViT layout): scaled down, never up, to at most ``max_patches`` patches
    and ``max_side`` patches a side, then padded right and below to a multiple of patch x merge; normalized by
    ``mean`` and ``std``. transformers' processor for it needs torchvision, whose wheels here are CUDA builds, so
    lilo makes the pixels itself with PIL (bicubic, as it does)."""

    max_patches: int = 16384
    max_side: int = 512
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)

    def scaled(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the scale, before the padding."""
        patch = self.patch_size
        patches = max(1, height // patch) * max(1, width // patch)
        scale = min(1.0, math.sqrt(self.max_patches / patches), self.max_side * patch / height,
                    self.max_side * patch / width)
        limit = self.max_side * patch
        return min(max(1, int(width * scale)), limit), min(max(1, int(height * scale)), limit)

    def resized(self, width: int, height: int) -> tuple[int, int]:
        return self.padded(*self.scaled(width, height))

    def padded(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of an image already ``scaled``, padded to a multiple of patch x merge. (Scaling the
        scaled image again may shrink it further: the sizes come from the image as sent, once.)"""
        factor = self.patch_size * self.merge_size
        return -(-width // factor) * factor, -(-height // factor) * factor

    def pixel_inputs(self, images: Sequence[DatumImage]) -> dict[str, Any]:
        import numpy as np
        import torch
        from PIL import Image

        patch, patches, grids = self.patch_size, [], []
        for image in _decoded(images):
            scaled = self.scaled(*image.size)
            if scaled != image.size:
                image = image.resize(scaled, Image.Resampling.BICUBIC)
            side_w, side_h = self.padded(*scaled)
            pixels = np.zeros((side_h, side_w, 3), np.float32)  # the padding: black, as transformers pads
            pixels[:image.height, :image.width] = np.asarray(image, np.float32) / 255.0
            pixels = (pixels - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
            rows, columns = side_h // patch, side_w // patch
            # Row-major patches, each channels x patch x patch.
            patches.append(pixels.reshape(rows, patch, columns, patch, 3).transpose(0, 2, 4, 1, 3)
                           .reshape(rows * columns, 3, patch, patch))
            grids.append([1, rows, columns])
        return {"pixel_values": torch.from_numpy(np.concatenate(patches)),
                "image_grid_thw": torch.tensor(grids, dtype=torch.long)}


def _decoded(images: Sequence[DatumImage]) -> list[Any]:
    from PIL import Image

    return [Image.open(io.BytesIO(image.data)).convert("RGB") for image in images]


def image_layout(directory: Path) -> ImageLayout | None:
    """The image layout of the model in ``directory``, or None where it takes no images (no vision tower in its
    config, or no image processor beside it)."""
    processor_file = directory / "preprocessor_config.json"
    return _layout(json.loads((directory / "config.json").read_text()),
                   json.loads(processor_file.read_text()) if processor_file.exists() else None, str(directory))


def image_layout_of(base_model: str) -> ImageLayout | None:
    """The image layout of a served base model, read without torch or transformers (the API's replicas load
    neither): from its directory, from the definition of a tiny one, or from the Hugging Face cache for a hub id;
    None where it takes no images or its files are nowhere here."""
    from lilo.backend.families import TINY
    from lilo.backend.registry import TINY_PREFIX, local_directory_of

    directory = local_directory_of(base_model)
    if directory is not None:
        return image_layout(directory)
    tiny = TINY.get(base_model.removeprefix(TINY_PREFIX))
    if base_model.startswith(TINY_PREFIX) and tiny is not None:
        return _layout(dict(tiny.config, model_type=tiny.model_type), tiny.image_processor, "")
    from huggingface_hub import try_to_load_from_cache

    files = [try_to_load_from_cache(base_model, name) for name in ("config.json", "preprocessor_config.json")]
    if not all(isinstance(path, str) for path in files):
        return None
    return image_layout(Path(files[0]).parent)


def _layout(config: dict[str, Any], processor: dict[str, Any] | None, directory: str) -> ImageLayout | None:
    if "vision_config" not in config or "image_token_id" not in config or processor is None:
        return None
    token = int(config["image_token_id"])
    if config.get("model_type") == "kimi_k25":
        # transformers' own keys, or those of the processor the hub's checkpoints ship as remote code.
        media = processor.get("media_proc_cfg") or {}
        size = processor.get("size") or {}
        merge = processor.get("merge_size", media.get("merge_kernel_size", 2))
        return NavitImages(token, int(processor.get("patch_size", media.get("patch_size", 14))),
                           int(merge[0] if isinstance(merge, (list, tuple)) else merge), directory,
                           max_patches=int(processor.get("max_patches", media.get("in_patch_limit", 16384))),
                           max_side=int(size.get("max_height", media.get("patch_limit_on_one_side", 512))),
                           mean=tuple(processor.get("image_mean", media.get("image_mean", (0.5,) * 3))),
                           std=tuple(processor.get("image_std", media.get("image_std", (0.5,) * 3))))
    size = processor.get("size") or {}
    return QwenImages(token, int(processor["patch_size"]), int(processor["merge_size"]), directory,
                      min_pixels=int(size.get("shortest_edge", processor.get("min_pixels", 0))),
                      max_pixels=int(size.get("longest_edge", processor.get("max_pixels", 0))))


@functools.lru_cache(maxsize=8)
def _processor(directory: str) -> Any:
    from transformers import AutoImageProcessor

    # PIL's backend: torchvision's wheels here are CUDA builds, and the two agree on the pixels.
    return AutoImageProcessor.from_pretrained(directory, backend="pil")


def multimodal_inputs(model: Any, layout: ImageLayout, input_ids: Any, attention_mask: Any,
                      images: Sequence[DatumImage], segments: Sequence[tuple[int, int]] | None = None,
                      images_per_row: Sequence[int] = (), positions: Any = None) -> dict[str, Any]:
    """The keyword arguments of a multimodal model's forward (``model.model``) for rows ``input_ids`` holding
    ``images`` in row order: the image features, computed once by the frozen vision tower without gradients, and
    the positions: ``positions`` (what a text pass of these rows takes) where the model's language model counts
    positions as text does (Kimi K2.5), else those of the model's own multimodal rotary index (Qwen-VL's 3-D ones;
    without them Qwen2.5-VL falls back to 1-D positions, silently). With ``segments``, ``input_ids`` is one packed
    row of sequences (each holding ``images_per_row`` of the images): each sequence's positions are its own, as if
    it were a row alone."""
    import torch

    device = input_ids.device
    pixels = layout.pixel_inputs(images)
    grid = pixels["image_grid_thw"].to(device)
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        features = model.get_image_features(pixels["pixel_values"].to(device, dtype), grid, return_dict=True)
    inputs = dict(input_ids=input_ids, image_grid_thw=grid, mm_encoder_outputs={"image": features})
    if not hasattr(model, "get_rope_index"):
        return dict(inputs, position_ids=positions)
    kinds = (input_ids == layout.image_token_id).int()
    if segments is None:
        rotary, _ = model.get_rope_index(input_ids, mm_token_type_ids=kinds, image_grid_thw=grid,
                                         attention_mask=attention_mask)
    else:
        firsts = [0, *itertools.accumulate(images_per_row)]
        rotary = torch.cat([
            model.get_rope_index(input_ids[:, start:end], mm_token_type_ids=kinds[:, start:end],
                                 image_grid_thw=grid[first:last] if last > first else None)[0]
            for (start, end), first, last in zip(segments, firsts, firsts[1:])], dim=-1)
    return dict(inputs, position_ids=rotary, mm_token_type_ids=kinds)
