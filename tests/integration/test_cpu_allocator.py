"""CPU mode keeps freed large buffers for reuse (integration/cpu_allocator.py).

Each case runs in a fresh interpreter: glibc's thresholds are process-wide and cannot be unset. The
probe mallocs, fills and frees a 40 MB buffer (above glibc's largest dynamic mmap threshold, 32 MB,
so glibc maps it anew each time unless told otherwise) and counts the minor page faults of the rounds
after the first. It calls malloc itself: torch's CPU allocator asks for 64-byte-aligned blocks, whose
padding can strand a freed block behind small allocations for a few rounds, which is glibc's heap
layout and not what is tested here. A buffer whose memory is reused faults on none of its pages;
one mapped anew faults on every 4 kB page, 10240 per round.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_pp_ext.integration.cpu_allocator import user_chose_thresholds

PAGES = 40 * 1024 * 1024 // 4096
ROUNDS = 8

PROBE = f"""
import ctypes, resource
from megatron_pp_ext.integration.cpu_allocator import keep_freed_buffers
print("set", keep_freed_buffers())
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def round_():
    buffer = libc.malloc({PAGES * 4096})
    ctypes.memset(buffer, 1, {PAGES * 4096})
    libc.free(buffer)
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({ROUNDS - 1}):
    round_()
print("faults", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def run_probe(**env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    was_set = out[0] == "set True"
    faults = int(out[1].split()[1])
    return was_set, faults


@glibc_only
def test_freed_buffers_are_reused() -> None:
    was_set, faults = run_probe()
    assert was_set
    # Reused memory: fewer faults in all later rounds together than one fresh mapping of the buffer has.
    assert faults < PAGES, faults


@glibc_only
def test_without_it_each_buffer_is_mapped_anew() -> None:
    """The probe's sensitivity: with the setting off, every round faults on the whole buffer again."""
    was_set, faults = run_probe(MEGATRON_PP_CPU_KEEP_FREED="0")
    assert not was_set
    assert faults >= (ROUNDS - 1) * PAGES, faults


def test_user_thresholds_are_left_alone() -> None:
    assert user_chose_thresholds({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert user_chose_thresholds({"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert user_chose_thresholds({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert not user_chose_thresholds({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert not user_chose_thresholds({})


@glibc_only
def test_user_setting_wins() -> None:
    was_set, _ = run_probe(MALLOC_TRIM_THRESHOLD_="131072")
    assert not was_set
