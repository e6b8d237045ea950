"""The split DESIGN.md fixes: ``lilo`` imports neither ``cluster`` nor ``serve`` (nor Ray); ``cluster`` not ``serve``."""

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
