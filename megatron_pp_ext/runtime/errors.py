"""The executor's own error (its own module, so the executor's helpers raise it without importing it)."""

from __future__ import annotations


class ExecutorError(RuntimeError):
    """The executor cannot run this schedule with these arguments."""


class CommStreamError(ExecutorError):
    """A node on megatron's communication stream (an expert-parallel all-to-all of the combined step)
    failed or did not finish within the bounded wait."""
