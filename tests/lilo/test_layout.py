"""The package split (docs/design.md): ``lilo`` imports neither ``cluster`` nor ``serve`` (nor Ray), and neither do
its tests, so tests/lilo runs without Ray (the Ray side: tests/cluster/test_control_plane_imports.py)."""

from pathlib import Path

import lilo
from helpers import imported_top_levels, imports_in, modules_of

HERE = Path(__file__).resolve().parent
RAY_SIDE = {"cluster", "serve", "ray"}


def test_the_library_imports_neither_the_actors_nor_the_serve_app_nor_ray():
    modules = modules_of(lilo)
    assert {"lilo.engine.engine", "lilo.futures.store", "lilo.timing.critical_path", "lilo.timing"} <= set(modules)
    loaded = imported_top_levels(modules)
    assert not loaded & RAY_SIDE, loaded & RAY_SIDE


def test_the_library_tests_import_neither_ray_nor_the_actors_nor_the_serve_app():
    """Importing every module of tests/lilo, as pytest does, loads none of them (nor do the shared helpers those
    modules import), and no test imports one later, inside a function."""
    files = sorted(HERE.glob("test_*.py"))
    assert len(files) > 20
    loaded = imported_top_levels([path.stem for path in files],
                                 search_path=(str(HERE.parents[1]), str(HERE.parent), str(HERE)))
    assert "lilo" in loaded and not loaded & RAY_SIDE, loaded & RAY_SIDE
    later = {f"{path.name} imports {module}" for path in files for module in imports_in(path)
             if module.split(".")[0] in RAY_SIDE}
    assert later == set()
