"""The operator's command line, `lilo` (its entry point is ``serve.cli:main``; ``python -m serve.cli`` runs it too)."""

from serve.cli.commands import main

__all__ = ["main"]
