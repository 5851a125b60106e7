"""The server's version: the installed qwen-jax distribution's (pyproject.toml), for --version, /version and the
OpenAPI document.

Reads package metadata only; never imports the engine.
"""

from __future__ import annotations

from importlib import metadata


def version() -> str:
    """The installed qwen-jax version ("unknown" when run from a checkout that was never installed)."""
    try:
        return metadata.version("qwen-jax")
    except metadata.PackageNotFoundError:
        return "unknown"
