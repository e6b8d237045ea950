"""The package split (docs/design.md) on the Ray side: ``cluster`` does not import ``serve``, and the control plane
loads no torch (the library's side: tests/lilo/test_layout.py)."""

import subprocess
import sys
from pathlib import Path

import cluster
from helpers import imported_top_levels, imports_in, modules_of

CLUSTER = Path(cluster.__file__).resolve().parent


def test_the_actors_do_not_import_the_serve_app():
    assert "serve" not in imported_top_levels(modules_of(cluster))


def test_the_control_plane_loads_no_torch():
    """The API replicas, the futures DB and recovery actors, and every process holding a trainer's handle (Ray
    imports the trainer's module there) start without torch, or the tinker SDK's package, which imports torch
    (its protobuf schema alone is loaded, as ``tinker.proto.tinker_public_pb2``)."""
    script = (
        "import importlib, sys\n"
        "for name in ['serve.app', 'serve.deploy', 'cluster.recovery', 'cluster.futures_actor',\n"
        "             'cluster.trainer.actor', 'cluster.timing']: importlib.import_module(name)\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    loaded = set(out.split())
    assert "tinker.proto.tinker_public_pb2" in loaded  # the schema the API decodes with
    assert not loaded & {"torch", "tinker", "transformers", "safetensors"}, loaded & {"torch", "tinker"}


def cluster_imports() -> dict[str, set[str]]:
    """Each module of ``cluster`` and the modules of ``cluster`` it imports anywhere (at its top, in a function or
    for type checking)."""
    graph = {}
    for path in CLUSTER.rglob("*.py"):
        parts = path.relative_to(CLUSTER.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[module] = {name for name in imports_in(path) if name.startswith("cluster.")}
    return graph


def test_the_trainer_and_the_sampling_plane_import_in_one_direction():
    graph = cluster_imports()
    assert {"cluster.trainer.actor", "cluster.trainer.ranks", "cluster.sampling.plane"} <= set(graph)
    # The sampling plane knows nothing of the trainer that relays to it.
    sampling = {module: imported for module, imported in graph.items() if module.startswith("cluster.sampling")}
    assert not any(name.startswith("cluster.trainer") for imported in sampling.values() for name in imported)
    # No module of cluster imports one that imports it back, however far round.
    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for name in graph.get(todo.pop(), ()):
                if name not in seen:
                    seen.add(name)
                    todo.append(name)
        return seen
    circles = sorted(module for module in graph if module in reaches(module))
    assert circles == [], circles
