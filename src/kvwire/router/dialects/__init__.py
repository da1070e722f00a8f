"""The router's engine kinds (``--engines``), by name: the one place that knows which exist.

A kind is a module that defines ``DIALECT``, a ``kvwire.router.dialects.base.Dialect`` (how an engine's
identity and health are learned, how many prompt bytes make a token). ``KINDS`` maps each name to that
module; a module is imported on the first lookup of its name. Adding an engine kind is its module plus one
line here (``docs/architecture.md``'s recipe).
"""

from __future__ import annotations

import importlib

from kvwire.errors import ConfigError
from kvwire.router.dialects.base import Dialect

# name -> the module whose ``DIALECT`` it is. One line per engine kind; the first is the default.
KINDS: dict[str, str] = {
    "kvwire": "kvwire.router.dialects.kvwire",
    "vllm": "kvwire.router.dialects.vllm",
}
DEFAULT_KIND = next(iter(KINDS))

_loaded: dict[str, Dialect] = {}


def names() -> tuple[str, ...]:
    return tuple(KINDS)


def lookup(name: str) -> Dialect:
    """The engine kind named ``name``; ``ConfigError`` naming the known ones otherwise."""
    found = _loaded.get(name)
    if found is not None:
        return found
    module = KINDS.get(name)
    if module is None:
        raise ConfigError(f"unknown engine kind {name!r}; known: {', '.join(KINDS)}")
    dialect = importlib.import_module(module).DIALECT
    if not isinstance(dialect, Dialect) or dialect.name != name:
        raise ConfigError(f"{module}.DIALECT is not the Dialect named {name!r}")
    _loaded[name] = dialect
    return dialect


def help_text() -> str:
    """``--engines``'s help: each kind's one line."""
    return "; ".join(f"{name}: {lookup(name).summary}" for name in KINDS)
