"""The SDK's generated protobuf module (package ``tinker_public``), loaded without the rest of the SDK.

``import tinker.proto.tinker_public_pb2`` would first run the SDK's package ``__init__``, which imports torch: a
second of start-up and about 200 MB in every API process, which needs only the schema. So the module is loaded
from its file, under its own name: a process that imports the SDK as well (a client, a test) shares this one
module, and protobuf registers the schema once.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

MODULE = "tinker.proto.tinker_public_pb2"


def load() -> ModuleType:
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    package = importlib.util.find_spec("tinker")  # finds the SDK without importing it
    if package is None or not package.submodule_search_locations:
        raise ImportError(
            "The tinker SDK is not installed; lilo takes its protobuf schema from it (pip install tinker).")
    spec = importlib.util.spec_from_file_location(
        MODULE, Path(package.submodule_search_locations[0]) / "proto" / "tinker_public_pb2.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[MODULE]
        raise
    return module
