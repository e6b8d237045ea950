"""serve/'s sub-packages by audience (docs/design.md, "Layout"), with one import direction: the HTTP plumbing
(``serve.http``) knows no audience, the Tinker API (``serve.tinker``) builds on it, the OpenAI-compatible endpoint and
the console on both but not on each other, the app that composes them (``serve.app``, ``serve.control``,
``serve.deploy``) on all, and the command line (``serve.cli``) on the app alone, never the other way."""

from pathlib import Path

from helpers import imports_in

SERVE = Path(__file__).resolve().parents[2] / "serve"
# Each part and the parts it may import besides itself.
MAY_IMPORT = {
    "http": set(),
    "tinker": {"http"},
    "openai": {"http", "tinker"},
    "console": {"http", "tinker"},
    "app": {"http", "tinker", "openai", "console"},
    "cli": {"app"},
}
COMPOSING_MODULES = {"app", "control", "deploy"}


def part_of(module: str) -> str:
    """The part a ``serve.X...`` module belongs to (the composing modules are one part, ``app``)."""
    name = module.split(".")[1]
    return "app" if name in COMPOSING_MODULES else name


def serve_modules() -> list[tuple[Path, str]]:
    """Every module of serve but the package's own ``__init__``: its file and its dotted name."""
    return [(path, path.relative_to(SERVE.parent).with_suffix("").as_posix().replace("/", "."))
            for path in sorted(SERVE.rglob("*.py")) if path != SERVE / "__init__.py"]


def test_every_module_of_serve_lies_in_one_part():
    modules = [module for _, module in serve_modules()]
    assert len(modules) > 30
    assert {part_of(module) for module in modules} == set(MAY_IMPORT), modules


def test_each_part_imports_only_the_parts_below_it():
    wrong = []
    for path, module in serve_modules():
        here = part_of(module)
        for imported in sorted(name for name in imports_in(path) if name.startswith("serve.")):
            there = part_of(imported)
            if there != here and there not in MAY_IMPORT[here]:
                wrong.append(f"{path.relative_to(SERVE.parent)} ({here}) imports {imported} ({there})")
    assert not wrong, "\n".join(wrong)
