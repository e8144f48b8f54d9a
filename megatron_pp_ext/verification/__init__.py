"""Verification harness: runs a schedule on real gloo ranks with a tiny GPT and compares it with the
single-process reference (``megatron-pp verify``). It owns the CPU shims; ``runtime/`` does not import it.

``megatron-pp verify``, by job: :mod:`..cli.verify_command` (the command) → :mod:`.verify` (the driver) →
:mod:`.reference` (the two reference runs) and :mod:`.run_spec` (what one run does, with its testing
hooks) → :mod:`.rank_pool` (the reused rank processes) → on every rank :mod:`.rank_setup` (process
groups), :mod:`.rank_model` (chunks and optimizer) and :mod:`.rank_run` (the training loop) →
:mod:`.compare` (the numbers), judged by :mod:`.criterion` → :mod:`.verify_report` (the verdict and its text).
The other modules are self-checks and benchmarks built on the same pieces.
"""
