"""Reversible replacement of a megatron function everywhere it is referenced.

Megatron modules often import functions by name (``from megatron.core.pipeline_parallel
import get_forward_backward_func``); replacing only the defining module's attribute leaves
those copies untouched. :class:`Patcher` replaces the attribute in the defining module and in
every loaded ``megatron`` module holding the same object, remembers what it replaced, and
puts everything back on :meth:`Patcher.restore` (including modules imported while patched,
which picked the replacement up by name).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import Any


def _holders(old: object, attr: str) -> list[Any]:
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "megatron" or name.startswith("megatron.")):
            continue
        try:
            if getattr(module, attr, None) is old:
                found.append(module)
        except Exception:  # pragma: no cover - lazy modules raising on attribute access
            continue
    return found


def replace_everywhere(module_name: str, attr: str, new: object) -> object:
    """Replace ``module_name.attr`` and every by-name copy in loaded megatron modules; return the old object."""
    module = importlib.import_module(module_name)
    old = getattr(module, attr)
    for holder in {id(m): m for m in [module, *_holders(old, attr)]}.values():
        setattr(holder, attr, new)
    return old


@dataclass
class Patcher:
    """Records replacements so that they can be undone."""

    _done: list[tuple[str, str, object, object]] = field(default_factory=list)
    _undo: list[Any] = field(default_factory=list)

    def on_restore(self, undo: Any) -> None:
        """Also call ``undo()`` on :meth:`restore` (for changes made by other means)."""
        self._undo.append(undo)

    def replace(self, module_name: str, attr: str, new: object) -> object:
        """Replace (idempotent per ``(module, attr)``: a second call swaps in ``new`` over the first)."""
        for i, (mod, name, original, current) in enumerate(self._done):
            if (mod, name) == (module_name, attr):
                for holder in [importlib.import_module(mod), *_holders(current, name)]:
                    setattr(holder, name, new)
                self._done[i] = (mod, name, original, new)
                return original
        original = replace_everywhere(module_name, attr, new)
        self._done.append((module_name, attr, original, new))
        return original

    def call_after(self, module_name: str, attr: str, then: Any) -> None:
        """Replace ``module.attr`` (as it is now, possibly already wrapped) by a call to it followed by
        ``then(result)``; the call's result is returned unchanged."""
        current = getattr(importlib.import_module(module_name), attr)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = current(*args, **kwargs)
            then(result)
            return result

        self.replace(module_name, attr, wrapped)

    def original(self, module_name: str, attr: str) -> object | None:
        for mod, name, original, _ in self._done:
            if (mod, name) == (module_name, attr):
                return original
        return None

    @property
    def active(self) -> bool:
        return bool(self._done)

    def restore(self) -> None:
        """Put every replaced attribute back, newest first."""
        while self._undo:
            self._undo.pop()()
        while self._done:
            module_name, attr, original, current = self._done.pop()
            module = importlib.import_module(module_name)
            for holder in {id(m): m for m in [module, *_holders(current, attr)]}.values():
                setattr(holder, attr, original)
