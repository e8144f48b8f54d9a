"""Benchmarks: emulated compute on real ranks, peer runtimes on the same chunks, A/B timing against
megatron's own schedules, and the blocks of a results file they write (``megatron-pp bench``,
``benchmarks/``)."""
