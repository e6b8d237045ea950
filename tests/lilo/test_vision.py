"""Image inputs at the ingress: an image's token count is the one the model's own image processor gives it, and an
image that is not a whole PNG or JPEG within the limits, or whose expected_tokens disagree, is refused saying what
to change."""

import ast
import dataclasses
import io
import math
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lilo.backend.families import TINY
from lilo.backend.models import build_tiny
from lilo.backend.types import DatumImage
from lilo.backend.vision import MAX_IMAGE_BYTES, PENDING, checked_image, image_layout, image_layout_of
from lilo.errors import InvalidRequestError


def encoded(width: int, height: int, format: str = "jpeg", seed: int = 0) -> bytes:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG" if format == "jpeg" else "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module", params=["tiny-qwen3-vl", "tiny-qwen2.5-vl", "tiny-qwen3.5-vl", "tiny-kimi-k2.5"])
def layout(request, tmp_path_factory):
    return image_layout(build_tiny(tmp_path_factory.mktemp(request.param), request.param))


# 134 x 441: under tiny Kimi's 256-patch budget, scaling its scaled size again would shrink it further.
@pytest.mark.parametrize("width, height", [(70, 100), (32, 32), (1, 1), (640, 480), (13, 900), (3000, 2000),
                                           (134, 441)])
def test_an_images_token_count_is_its_processors(layout, width, height):
    data = encoded(width, height)
    grid = layout.pixel_inputs([DatumImage(data, "jpeg", 0, None)])["image_grid_thw"]
    assert layout.token_count(width, height) == int(grid.prod()) // layout.merge_size**2


def test_images_are_laid_out_as_the_models_image_token_and_a_wrong_count_is_refused_naming_both(layout):
    image = encoded(70, 100)
    count = layout.token_count(70, 100)
    tokens = [5, 6, *[PENDING] * count, 7]
    laid, placed = layout.lay_out(tokens, [DatumImage(image, "jpeg", 2, count)], "Datum 0")
    assert laid == [5, 6, *[layout.image_token_id] * count, 7] and placed[0].offset == 2
    # Without a count (a sampling prompt may leave it out) the image's positions are inserted.
    laid, placed = layout.lay_out([5, 6, 7], [DatumImage(image, "jpeg", 2, None)], "Prompt")
    assert laid == [5, 6, *[layout.image_token_id] * count, 7] and placed[0].tokens == count
    with pytest.raises(InvalidRequestError, match=rf"expected_tokens is {count + 1}, but a 70 x 100 image is "
                                                  rf"{count} tokens"):
        layout.lay_out([5, 6, *[PENDING] * (count + 1), 7], [DatumImage(image, "jpeg", 2, count + 1)], "Datum 0")


def navit_resize_of_transformers():
    """transformers' own ``navit_resize`` (Kimi K2.5's image processor), taken from its source file: the module
    imports torchvision, whose wheels here are CUDA builds that do not load beside the CPU torch."""
    import transformers

    source = Path(transformers.__file__).parent / "models" / "kimi_k25" / "image_processing_kimi_k25.py"
    function = next(node for node in ast.parse(source.read_text()).body
                    if isinstance(node, ast.FunctionDef) and node.name == "navit_resize")
    namespace = {"math": math}
    exec(compile(ast.Module([function], type_ignores=[]), str(source), "exec"), namespace)
    return namespace["navit_resize"]


@pytest.fixture(scope="module")
def kimi_layout(tmp_path_factory):
    return image_layout(build_tiny(tmp_path_factory.mktemp("kimi"), "tiny-kimi-k2.5"))


@pytest.mark.parametrize("max_patches, max_side", [(256, 32), (16384, 512), (1024, 20)])
@pytest.mark.parametrize("width, height", [(70, 100), (1, 1), (13, 900), (640, 480), (3000, 2000), (7168, 30)])
def test_kimis_token_count_is_what_transformers_resize_gives(kimi_layout, width, height, max_patches, max_side):
    layout = dataclasses.replace(kimi_layout, max_patches=max_patches, max_side=max_side)
    _, (pad_height, pad_width) = navit_resize_of_transformers()(height, width, 14, 2, max_patches, max_side)
    assert layout.resized(width, height) == (pad_width, pad_height)
    assert layout.token_count(width, height) == (pad_height // 14) * (pad_width // 14) // 4


def test_a_text_only_model_has_no_image_layout(tmp_path):
    assert image_layout(build_tiny(tmp_path, "tiny-llama")) is None
    assert TINY["tiny-qwen3-vl"].image_processor is not None


def bomb_png(width: int, height: int) -> bytes:
    """A valid PNG header claiming ``width`` x ``height`` pixels, and little else."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + \
        chunk(b"IEND", b"")


@pytest.mark.parametrize("data, format, message", [
    (encoded(8, 8), "gif", "format 'gif' is not supported; send png or jpeg"),
    (encoded(8, 8, "png"), "jpeg", "not a JPEG file"),
    (b"\xff\xd8\xff" + b"\0" * (MAX_IMAGE_BYTES + 1), "jpeg", "over the 2,097,152 an image may be"),
    (bomb_png(8_000, 8_000), "png", "claims 8000 x 8000 pixels, over the 40,000,000"),
    (bomb_png(100_000, 100_000), "png", "claims more pixels than the 40,000,000"),
    (encoded(64, 64)[:300], "jpeg", "does not decode"),
], ids=["format", "not-that-format", "too-large", "bomb", "huge-bomb", "truncated"])
def test_a_bad_image_is_refused_saying_what_to_change(data, format, message):
    with pytest.raises(InvalidRequestError, match=message):
        checked_image(data, format, "Datum 0, chunk 1")
    assert checked_image(encoded(9, 7), "jpeg", "Datum 0") == (9, 7)


def test_the_wire_takes_image_chunks_with_their_counts_and_refuses_audio():
    from lilo.protocol.proto import decode_forward_backward, pb

    def request(*chunks):
        return pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy", data=[
            pb.Datum(model_input=list(chunks))]).SerializeToString()

    text = pb.Chunk(encoded_text=pb.EncodedTextChunk(tokens=np.asarray([5, 6], "<i4").tobytes()))
    image = pb.Chunk(image=pb.ImageChunk(data=encoded(8, 8), format="jpeg", expected_tokens=4))
    (datum,) = decode_forward_backward(request(text, image, text)).train.data
    assert list(datum.tokens) == [5, 6, PENDING, PENDING, PENDING, PENDING, 5, 6]
    assert [(i.offset, i.tokens, i.format) for i in datum.images] == [(2, 4, "jpeg")]
    with pytest.raises(InvalidRequestError, match="chunk 1: the image chunk has no expected_tokens"):
        decode_forward_backward(request(text, pb.Chunk(image=pb.ImageChunk(data=encoded(8, 8), format="jpeg"))))
    with pytest.raises(InvalidRequestError, match=r"chunk 0: dmel \(audio\) chunks are not supported"):
        decode_forward_backward(request(pb.Chunk(dmel=pb.DmelChunk())))


def test_the_ingress_reads_a_base_models_image_layout_without_torch(tmp_path):
    import subprocess
    import sys

    directory = build_tiny(tmp_path / "vl", "tiny-qwen2.5-vl")
    script = ("import sys\nfrom lilo.backend.vision import image_layout_of\n"
              f"print(image_layout_of('lilo/tiny-qwen3-vl').patch_size, image_layout_of({str(directory)!r}).patch_size,"
              " image_layout_of('lilo/tiny-llama'))\n"
              "print('torch' in sys.modules or 'transformers' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["16", "14", "None", "False"]
    assert image_layout_of("lilo/tiny-qwen3-vl") == dataclasses.replace(
        image_layout(build_tiny(tmp_path / "v3", "tiny-qwen3-vl")), directory="")
