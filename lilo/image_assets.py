"""Images a request points at instead of carrying: the Tinker API's ``image_asset_pointer`` chunks (``location``)
and the OpenAI endpoint's ``image_url`` parts with a ``file://`` URL.

lilo fetches nothing from the network, so it resolves ``file://`` URLs only, and only under the directories its
operator allows (``--image-dir``, none by default): the ingress reads the file (symlinks followed, then checked to
lie under an allowed directory), at most ``MAX_IMAGE_BYTES``, and the request goes on as if it had sent the bytes.
On a cluster the ingress runs on the head, so the directories are the head's (or a mount it shares).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence
from urllib.parse import unquote, urlsplit

from lilo.backend.vision import MAX_IMAGE_BYTES
from lilo.errors import InvalidRequestError

FILE_SCHEME = "file://"


class ImageAssets:
    """Reads images by ``file://`` URL from under ``directories``."""

    def __init__(self, directories: Sequence[Path | str] = ()) -> None:
        self.directories = tuple(Path(directory).resolve() for directory in directories)

    def read(self, location: object, where: str) -> bytes:
        """The bytes of the image at ``location``, or InvalidRequestError saying what lilo resolves."""
        if not isinstance(location, str) or not location.startswith(FILE_SCHEME):
            scheme = location.split(":", 1)[0] if isinstance(location, str) and ":" in location else "no"
            raise InvalidRequestError(f"{where}: the image's location has {scheme} scheme; lilo resolves file:// "
                                      f"URLs under {self._allowed()} only (it fetches nothing from the network); "
                                      "send the image's bytes instead.")
        parts = urlsplit(location)
        if parts.netloc not in ("", "localhost"):
            raise InvalidRequestError(f"{where}: file://{parts.netloc}/... names another host; lilo reads files of "
                                      "its own, file:///path.")
        path = Path(unquote(parts.path)).resolve()
        if not any(path.is_relative_to(directory) for directory in self.directories):
            raise InvalidRequestError(f"{where}: {location} is not under {self._allowed()}; lilo reads images from "
                                      "there only.")
        try:
            size = os.stat(path).st_size
            if size > MAX_IMAGE_BYTES:
                raise InvalidRequestError(f"{where}: {location} is {size:,} bytes, over the {MAX_IMAGE_BYTES:,} an "
                                          "image may have; downscale it.")
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise InvalidRequestError(f"{where}: there is no image file at {location}.") from None
        except PermissionError:
            raise InvalidRequestError(f"{where}: lilo may not read {location}; check its permissions.") from None

    def _allowed(self) -> str:
        if not self.directories:
            return "the directories its operator allows (none: lilo up --image-dir DIR allows one)"
        return "the allowed directories (" + ", ".join(str(directory) for directory in self.directories) + ")"


NO_ASSETS = ImageAssets()
