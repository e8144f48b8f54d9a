"""Verification harness: runs a schedule on real gloo ranks with a tiny GPT and compares it with the
single-process reference (``megatron-pp verify``). It owns the CPU shims; ``runtime/`` does not import it."""
