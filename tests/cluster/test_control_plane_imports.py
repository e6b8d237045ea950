"""The package split (docs/design.md) on the Ray side: ``cluster`` does not import ``serve``, and the control plane
loads no torch (the library's side: tests/lilo/test_layout.py)."""

import subprocess
import sys

import cluster
from helpers import imported_top_levels, modules_of


def test_the_actors_do_not_import_the_serve_app():
    assert "serve" not in imported_top_levels(modules_of(cluster))


def test_the_control_plane_loads_no_torch():
    """The API replicas, the futures DB and recovery actors, and every process holding a trainer's handle (Ray
    imports the trainer's module there) start without torch, or the tinker SDK's package, which imports torch
    (its protobuf schema alone is loaded, as ``tinker.proto.tinker_public_pb2``)."""
    script = (
        "import importlib, sys\n"
        "for name in ['serve.app', 'serve.deploy', 'cluster.recovery', 'cluster.futures_actor',\n"
        "             'cluster.trainer_actor', 'cluster.timing']: importlib.import_module(name)\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    loaded = set(out.split())
    assert "tinker.proto.tinker_public_pb2" in loaded  # the schema the API decodes with
    assert not loaded & {"torch", "tinker", "transformers", "safetensors"}, loaded & {"torch", "tinker"}
