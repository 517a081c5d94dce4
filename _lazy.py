"""Lazy re-exports for packages: ``import kvtrio`` stays light, names load on first use.

trio re-exports its API through ``trio``; kvtrio does the same without importing MLX at
``import kvtrio``: each package lists ``name -> module`` and gets a module ``__getattr__``
(PEP 562) that imports the module on first access and caches the value, and a
``__dir__`` that lists every exported name.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, exporting each ``name`` from its module."""

    def __getattr__(name: str) -> Any:
        try:
            module = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(exports) | set(vars(sys.modules[package])))

    return __getattr__, __dir__
