"""Keep freed large buffers in the process on CPU ranks, as a GPU's caching allocator does.

On CUDA, PyTorch's caching allocator keeps a freed activation or gradient buffer and hands it to the
next request of that size, so a pipeline schedule's op costs do not depend on how many buffers the
schedule keeps alive between ops. glibc's malloc does the opposite for large blocks: a request above
its mmap threshold gets a fresh mapping that is returned to the kernel when freed, and a free heap top
above the trim threshold is trimmed; the next buffer of that size page-faults in anew (about one fault
per 4 kB). The dynamic threshold glibc applies absorbs some of that, not all, and what it misses
depends on how many buffers a schedule keeps alive between ops: with a 20480-word vocabulary and
hidden size 256 on two ranks, zb-h1 (B and W split) took 5-7x more page faults than with the
thresholds raised, and its last rank's W ops 20-70% longer.

:func:`keep_freed_buffers` raises both thresholds to their maximum through ``mallopt`` so a CPU rank
reuses freed memory instead. A rank's resident size no longer shrinks after a peak, as on a GPU, and
can exceed the peak of live tensors by what fragmentation strands (as a caching allocator's reserve
exceeds its allocated bytes). It leaves the allocator alone where the user has chosen its thresholds
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or the ``GLIBC_TUNABLES`` entries), where
``MEGATRON_PP_CPU_KEEP_FREED=0``, and where the C library has no glibc ``mallopt``.
"""

from __future__ import annotations

import ctypes
import os
import sys

# glibc <malloc.h>: the parameters mallopt takes, and the largest value it can be given (an int).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 2**31 - 1

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_USER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")


def user_chose_thresholds(environ: dict[str, str] | None = None) -> bool:
    """True when the environment sets glibc's mmap or trim threshold itself."""
    env = os.environ if environ is None else environ
    if any(name in env for name in _USER_SETTINGS):
        return True
    tunables = env.get("GLIBC_TUNABLES", "")
    return any(name in tunables for name in _USER_TUNABLES)


def keep_freed_buffers() -> bool:
    """Set glibc's mmap and trim thresholds to their maximum; True when both were set.

    Process-wide and permanent; processes forked afterwards inherit it.
    """
    if os.environ.get("MEGATRON_PP_CPU_KEEP_FREED", "1") == "0" or user_chose_thresholds():
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
