"""Pause Python's cyclic garbage collector while large acyclic structures are built.

Generating, lowering and simulating a big schedule allocates hundreds of thousands of small
tuples and lists; none of them form reference cycles, but each allocation burst triggers full
collections that rescan everything built so far (a third of the time of a 262k-op schedule).
Reference counting still frees everything as usual.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["cyclic_gc_paused"]


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block (if it was enabled), re-enable after."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
