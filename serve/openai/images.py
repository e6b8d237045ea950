"""Images in OpenAI chat messages: ``image_url`` content parts whose URL is a ``data:`` URL (``data:image/jpeg;base64,
...``, as the ``openai`` package's docs write one) or a ``file://`` URL under a directory the operator allows
(``lilo.image_assets``). The chat template writes one image token where each image goes
(Qwen-VL's ``<|vision_start|><|image_pad|><|vision_end|>``); each becomes as many as the image's size makes, as the
Tinker API's image chunks do (``lilo.backend.vision``)."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any, Sequence

from lilo.backend.types import DatumImage
from lilo.backend.vision import ImageLayout
from lilo.errors import InvalidRequestError
from lilo.image_assets import FILE_SCHEME, NO_ASSETS, ImageAssets

DATA_URL = re.compile(r"data:image/(png|jpeg|jpg);base64,(.*)", re.DOTALL)


def image_part(number: int, part: dict[str, Any], assets: ImageAssets = NO_ASSETS) -> bytes | None:
    """The image an ``image_url`` part holds (None for any other part), refused with a sentence where its URL is not
    a base64 PNG or JPEG data URL or a file:// URL ``assets`` reads."""
    if part.get("type") != "image_url":
        return None
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if isinstance(url, str) and url.startswith(FILE_SCHEME):
        return assets.read(url, f"messages[{number}]")
    match = DATA_URL.fullmatch(url) if isinstance(url, str) else None
    if match is None:
        scheme = url.split(":", 1)[0] if isinstance(url, str) and ":" in url else "no"
        raise InvalidRequestError(f"messages[{number}] has an image_url with {scheme} URL; lilo reads images from "
                                  "data: URLs (data:image/jpeg;base64,... or data:image/png;base64,...) and file:// "
                                  "URLs under the directories its operator allows, as it fetches nothing from the "
                                  "network.")
    try:
        return base64.b64decode(match.group(2), validate=True)
    except binascii.Error:
        raise InvalidRequestError(f"messages[{number}] has an image_url whose data is not base64.") from None


def image_format(data: bytes) -> str:
    return "png" if data.startswith(b"\x89PNG") else "jpeg"


def with_images(prompt: Sequence[int], images: Sequence[bytes], layout: ImageLayout | None,
                ) -> tuple[list[int], tuple[DatumImage, ...]]:
    """The rendered ``prompt`` with each image's one image token as many as the image makes, in order."""
    if not images:
        return list(prompt), ()
    if layout is None:
        raise InvalidRequestError("This base model takes no images (it has no vision tower); send text parts only.")
    places = [position for position, token in enumerate(prompt) if token == layout.image_token_id]
    if len(places) != len(images):
        raise InvalidRequestError(f"The chat template wrote {len(places)} image tokens for {len(images)} images; "
                                  "this model's template does not place images as lilo expects.")
    text = [token for token in prompt if token != layout.image_token_id]
    pending = [DatumImage(data, image_format(data), place - number, None)
               for number, (place, data) in enumerate(zip(places, images))]
    return layout.lay_out(text, pending, "The chat")
