"""serve/'s sub-packages by audience (docs/design.md, "Layout"), with one import direction: the HTTP plumbing
(``serve.http``) knows no audience, the Tinker API (``serve.tinker``) builds on it, the OpenAI-compatible endpoint and
the console on both but not on each other, the app that composes them (``serve.app``, ``serve.control``,
``serve.deploy``) on all, and the command line (``serve.cli``) on the app alone, never the other way."""

import ast
from pathlib import Path

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


def serve_imports(path: Path) -> set[str]:
    """The ``serve.*`` modules a file imports anywhere: at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("serve.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.startswith("serve."):
            found.add(node.module)
    return found


def test_every_module_of_serve_lies_in_one_part():
    modules = [path.relative_to(SERVE.parent).with_suffix("").as_posix().replace("/", ".")
               for path in SERVE.rglob("*.py") if path.name != "__init__.py" or path.parent != SERVE]
    assert len(modules) > 30
    assert {part_of(module) for module in modules} == set(MAY_IMPORT), sorted(modules)


def test_each_part_imports_only_the_parts_below_it():
    wrong = []
    for path in sorted(SERVE.rglob("*.py")):
        if path.parent == SERVE and path.name == "__init__.py":
            continue
        here = part_of(path.relative_to(SERVE.parent).with_suffix("").as_posix().replace("/", "."))
        for imported in serve_imports(path):
            there = part_of(imported)
            if there != here and there not in MAY_IMPORT[here]:
                wrong.append(f"{path.relative_to(SERVE.parent)} ({here}) imports {imported} ({there})")
    assert not wrong, "\n".join(wrong)
