"""Switchboard's version, as the installed package names it."""

from __future__ import annotations

from functools import cache
from importlib import metadata


@cache
def version() -> str:
    try:
        return metadata.version("switchboard")
    except metadata.PackageNotFoundError:  # (run from a source tree that was never installed)
        return "source"
