"""A package's names imported on first use (PEP 562), so that importing one of its
modules does not import all of them (a lazy layer's server starts on a sandbox's
critical path and needs few)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """The package's ``__getattr__``: ``where`` maps each name to its module."""

    def getattr_(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return getattr_
