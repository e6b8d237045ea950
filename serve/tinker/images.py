"""Images at the ingress: each datum's (or prompt's) image chunks laid out as its base model's image token, as many
as the model's image processor makes of that image, before anything is recorded or counted; refused, saying why,
where the base model takes no images or a chunk is not a usable image (``lilo.backend.vision``)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Any, Sequence

import numpy as np

from lilo.backend.types import DatumImage, TrainInput
from lilo.backend.vision import ImageLayout, image_layout_of
from lilo.errors import InvalidRequestError


_layout = functools.lru_cache(maxsize=16)(image_layout_of)


async def layout_of(base_model: str) -> ImageLayout:
    """The image layout of ``base_model`` (read once, off the event loop); a 400 where it takes no images."""
    layout = await asyncio.to_thread(_layout, base_model)
    if layout is None:
        raise InvalidRequestError(f"Base model {base_model!r} takes no images (it has no vision tower); send text "
                                  "only, or use a vision-language base model (lilo/tiny-qwen3-vl, Qwen3-VL, "
                                  "Qwen2.5-VL).")
    return layout


def image_fingerprints(images: Sequence[DatumImage]) -> list[dict[str, Any]]:
    """What the ledger's fingerprint of a request holds of its images: their bytes' hashes, formats and places."""
    return [{"sha256": image.sha256, "format": image.format, "offset": image.offset, "tokens": image.tokens}
            for image in images]


async def with_images_laid_out(train: TrainInput, base_model: str) -> TrainInput:
    """``train`` with every datum's images laid out for ``base_model``."""
    layout = await layout_of(base_model)
    data = []
    for index, datum in enumerate(train.data):
        if datum.images:
            tokens, images = layout.lay_out(list(np.asarray(datum.tokens)), datum.images, f"Datum {index}")
            datum = dataclasses.replace(datum, tokens=np.asarray(tokens, dtype=np.int32), images=images)
        data.append(datum)
    return dataclasses.replace(train, data=data)


def has_images(train: TrainInput) -> bool:
    return any(datum.images for datum in train.data)


