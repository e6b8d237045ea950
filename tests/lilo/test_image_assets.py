"""Images a request points at (lilo.image_assets): file:// URLs under the allowed directories, read whole; anything
else refused with a sentence saying what lilo resolves."""

import pytest

from lilo.backend.vision import MAX_IMAGE_BYTES
from lilo.errors import InvalidRequestError
from lilo.image_assets import ImageAssets
from lilo.settings import SettingsError, load_settings


@pytest.fixture
def allowed(tmp_path):
    directory = tmp_path / "images"
    (directory / "nested").mkdir(parents=True)
    (directory / "nested" / "a.png").write_bytes(b"\x89PNG...")
    return directory


def test_a_file_under_an_allowed_directory_is_read(allowed):
    assets = ImageAssets([allowed])
    assert assets.read(f"file://{allowed}/nested/a.png", "Prompt chunk 1") == b"\x89PNG..."
    assert assets.read(f"file://localhost{allowed}/nested/a%2Epng", "Prompt chunk 1") == b"\x89PNG..."


@pytest.mark.parametrize(("location", "words"), [
    ("https://example.com/a.png", "has https scheme; lilo resolves file:// URLs under the allowed directories"),
    ("s3://bucket/a.png", "has s3 scheme"),
    (None, "has no scheme"),
    ("file://otherhost/a.png", "names another host"),
    ("file:///etc/hostname", "is not under the allowed directories"),
    ("file://{allowed}/../escape.png", "is not under the allowed directories"),
    ("file://{allowed}/missing.png", "there is no image file"),
    ("file://{allowed}/nested", "there is no image file"),
])
def test_anything_else_is_refused_saying_what_lilo_resolves(allowed, location, words):
    location = location.format(allowed=allowed) if isinstance(location, str) else location
    with pytest.raises(InvalidRequestError, match=words):
        ImageAssets([allowed]).read(location, "Prompt chunk 1")


def test_a_link_out_of_the_directory_and_an_oversized_file_are_refused(allowed, tmp_path):
    (tmp_path / "secret.png").write_bytes(b"x")
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    with pytest.raises(InvalidRequestError, match="is not under"):
        ImageAssets([allowed]).read(f"file://{allowed}/link.png", "Prompt chunk 1")
    (allowed / "big.png").write_bytes(b"\0" * (MAX_IMAGE_BYTES + 1))
    with pytest.raises(InvalidRequestError, match="over the 2,097,152 an image may have"):
        ImageAssets([allowed]).read(f"file://{allowed}/big.png", "Prompt chunk 1")


def test_without_allowed_directories_the_refusal_says_how_to_allow_one(allowed):
    with pytest.raises(InvalidRequestError, match="none: lilo up --image-dir DIR allows one"):
        ImageAssets().read(f"file://{allowed}/nested/a.png", "Prompt chunk 1")


def test_image_dirs_come_from_the_flag_or_the_environment_and_must_be_directories(allowed):
    where = {"home": "/tmp/lilo-image-dirs", "ray_address": "auto"}  # a short home: it is never created
    assert load_settings(env={}, image_dirs=[allowed], **where).image_dirs == (allowed,)
    both = {"LILO_IMAGE_DIRS": f"{allowed}:{allowed / 'nested'}"}
    assert load_settings(env=both, **where).image_dirs == (allowed, allowed / "nested")
    with pytest.raises(SettingsError, match="is not a directory"):
        load_settings(env={}, image_dirs=[allowed / "nested" / "a.png"], **where)
