"""The package split (docs/design.md): ``lilo`` imports neither ``cluster`` nor ``serve`` (nor Ray); ``cluster`` not ``serve``."""

import pkgutil
import subprocess
import sys

import cluster
import lilo


def imported_top_levels(packages: list[str]) -> set[str]:
    script = (
        "import importlib, sys\n"
        f"for name in {packages!r}: importlib.import_module(name)\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def modules_of(package) -> list[str]:
    return [package.__name__] + [m.name for m in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}.")]


def test_the_library_imports_neither_the_actors_nor_the_serve_app_nor_ray():
    modules = modules_of(lilo)
    assert {"lilo.engine.engine", "lilo.futures.store", "lilo.telemetry.critical_path", "lilo.timing"} <= set(modules)
    loaded = imported_top_levels(modules)
    assert not loaded & {"cluster", "serve", "ray"}, loaded & {"cluster", "serve", "ray"}


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
    loaded = set(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split())
    assert "tinker.proto.tinker_public_pb2" in loaded  # the schema the API decodes with
    assert not loaded & {"torch", "tinker", "transformers", "safetensors"}, loaded & {"torch", "tinker"}
