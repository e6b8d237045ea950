"""lilo: a self-hosted, Tinker-compatible service that trains many LoRA adapters at once on one base model.

This package is the library; it imports neither the Ray actors (``cluster``) nor the Serve app (``serve``).
"""

__version__ = "0.1.0"
