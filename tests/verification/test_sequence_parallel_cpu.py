"""Sequence parallelism in CPU mode: megatron's torch norm with its gradients summed over the tensor-parallel group.

``verify`` compares a schedule with megatron's own run at the same tensor-parallel size, so it cannot see an error
that megatron's tensor-parallel run shares. This checks that run itself against ground truth: megatron's
no-pipelining schedule in float64 with TP = 2 and sequence parallelism against the same at TP = 1. The norms'
weights and biases are whole on every tensor-parallel rank; their gradients must be the TP = 1 ones on both ranks
(float64: equal up to the regrouping of the sum over the sequence, ~1e-15 relative; a norm gradient from one
rank's half of the sequence only is ~50% off).
"""

from __future__ import annotations

import re

import torch

from megatron_pp_ext.verification.run_spec import NATIVE, RunSpec
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec

NORM = re.compile(r"layernorm\.(weight|bias)#")
FLOAT64_REGROUPED = 1e-12  # relative: a regrouped float64 sum of a few hundred terms (2^-52 x terms, with room)


def _norm_grads(result: list[dict], tp_rank: int) -> dict[str, torch.Tensor]:
    grads = {}
    for rank in result:
        for key, value in rank["grads"][-1].items():
            if NORM.search(key) and f"#tp{tp_rank}#" in key:
                grads[key.split("#")[0]] = value
    return grads


def test_norm_gradients_under_sequence_parallelism_are_the_unsplit_ones(pool):
    model = TinyGPTSpec(num_layers=2)
    common = {"pp": 1, "num_microbatches": 2, "mode": NATIVE, "model": model, "float64": True, "iterations": 1}
    whole = pool.run(RunSpec(tp=1, **common))
    split = pool.run(RunSpec(tp=2, sequence_parallel=True, **common))
    want = _norm_grads(whole, 0)
    assert len(want) >= 5  # two layers' input and pre-MLP norms, the final norm: weights and biases
    for tp_rank in (0, 1):
        got = _norm_grads(split, tp_rank)
        assert sorted(got) == sorted(want)
        for name, g in want.items():
            error = float((got[name] - g).norm() / g.norm())
            assert error < FLOAT64_REGROUPED, (tp_rank, name, error)
