"""Our memory model next to ``megatron.training.theoretical_memory_usage`` (megatron-core 0.19.2).

Used by ``test_memory.py`` and to produce the table in ``benchmarks/RESULTS.md``::

    python tests/planner/megatron_theory.py            # markdown table of every case

Megatron's estimator covers dense GPTs trained in bf16 with Adam, the 1F1B and interleaved
schedules, tied embeddings, and (for activations) selective recompute: with sequence parallelism
``compute_activation_memory`` (Korthikanti et al.'s ``34 sbh / t`` per layer), without it
``compute_activation_memory_without_sp`` (``sbh (10 + 24/t)`` per layer, times 1.05 "for
optimizer and miscellaneous temporaries"). It reports the most loaded rank, the first pipeline
stage. The cases below are compared on that rank with our model set up the same way
(``precision=bf16``, ``recompute=selective``, unfused attention, sequence parallelism when TP > 1).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MB = 1024 * 1024


@dataclass(frozen=True)
class Case:
    model: str
    schedule: str
    tp: int
    pp: int
    dp: int
    micro_batch: int
    num_microbatches: int
    v: int | None = None
    distributed_optimizer: bool = False
    sequence_parallel: bool = True

    @property
    def label(self) -> str:
        vp = f" v={self.v}" if self.v else ""
        extra = (" distopt" if self.distributed_optimizer else "") + (
            " SP" if self.sequence_parallel and self.tp > 1 else ""
        )
        return (
            f"{self.model} {self.schedule}{vp} t={self.tp} p={self.pp} d={self.dp} "
            f"b={self.micro_batch} m={self.num_microbatches}{extra}"
        )


CASES = (
    Case("zb-1.5b", "1f1b", 1, 2, 4, 6, 8),
    Case("zb-1.5b", "1f1b", 1, 1, 8, 4, 4),
    Case("zb-6.2b", "1f1b", 1, 5, 1, 3, 3),
    Case("zb-6.2b", "interleaved-1f1b", 2, 3, 2, 2, 12, v=2, distributed_optimizer=True),
    Case("zb-6.2b", "1f1b", 2, 3, 2, 2, 12, sequence_parallel=False),
    Case("cm-21b", "1f1b", 4, 2, 2, 1, 8, distributed_optimizer=True),
    Case("cm-38.5b", "1f1b", 8, 2, 1, 1, 16),
    Case("bf-52b", "interleaved-1f1b", 8, 8, 2, 1, 16, v=2, distributed_optimizer=True),
    Case("cm-98.5b", "1f1b", 4, 6, 1, 1, 12),
    Case("cm-98.5b", "interleaved-1f1b", 8, 3, 2, 1, 12, v=2, distributed_optimizer=True),
)


def ours(case: Case) -> dict[str, float]:
    """Our model, rank 0 (first stage), in MiB."""
    from megatron_pp_ext.planner.evaluate import estimate_memory
    from megatron_pp_ext.planner.memory import TrainingSetup
    from megatron_pp_ext.planner.models import get_model

    setup = TrainingSetup(
        precision="bf16",
        distributed_optimizer=case.distributed_optimizer,
        sequence_parallel=case.sequence_parallel,
        attention="unfused",
    )
    mem = estimate_memory(
        get_model(case.model),
        setup,
        case.schedule,
        tp=case.tp,
        pp=case.pp,
        dp=case.dp,
        micro_batch=case.micro_batch,
        num_microbatches=case.num_microbatches,
        v=case.v,
        recompute="selective",
        layer_split="even",
    )[0]
    return {"weights_optimizer": mem.static / MB, "activation": mem.activations / MB, "total": mem.total / MB}


def megatron_args(case: Case) -> dict[str, object]:
    from megatron_pp_ext.planner.models import get_model

    model = get_model(case.model)
    return {
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "ffn_hidden_size": model.ffn,
        "num_attention_heads": model.num_attention_heads,
        "kv_channels": model.head_dim,
        "group_query_attention": False,
        "num_query_groups": model.num_attention_heads,
        "seq_length": model.seq_length,
        "padded_vocab_size": model.padded_vocab_size(case.tp),
        "untie_embeddings_and_output_weights": model.untie_embeddings_and_output_weights,
        "swiglu": model.swiglu,
        "normalization": model.normalization,
        "add_bias_linear": model.add_bias_linear,
        "num_experts": None,
        "moe_shared_expert_intermediate_size": None,
        "moe_latent_size": None,
        "moe_router_topk": 2,
        "moe_layer_freq": 1,
        "moe_ffn_hidden_size": None,
        "mtp_num_layers": None,
        "multi_latent_attention": False,
        "expert_tensor_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "tensor_model_parallel_size": case.tp,
        "pipeline_model_parallel_size": case.pp,
        "data_parallel_size": case.dp,
        "world_size": case.tp * case.pp * case.dp,
        "virtual_pipeline_model_parallel_size": case.v,
        "use_distributed_optimizer": case.distributed_optimizer,
        "sequence_parallel": case.sequence_parallel and case.tp > 1,
        "recompute_granularity": "selective",
        "micro_batch_size": case.micro_batch,
        "num_microbatches": case.num_microbatches,
    }


_MEGATRON_SIDE = r"""
import json, sys, types
from megatron_pp_ext.integration import cpu
cpu._define_typing_override()
cpu._stub_triton_modules()
from megatron.training import theoretical_memory_usage as tmu
out = []
for raw in json.load(sys.stdin):
    m = raw.pop("num_microbatches")
    args = types.SimpleNamespace(**raw)
    weights = tmu.compute_weight_and_optimizer_memory(args) / tmu.NUM_BYTES_IN_MEGABYTE
    if args.sequence_parallel and args.recompute_granularity == "selective":
        act = tmu.compute_activation_memory(args, num_microbatches=m) / tmu.NUM_BYTES_IN_MEGABYTE
        formula = "with SP"
    else:
        act = tmu.compute_activation_memory_without_sp(args, num_microbatches=m) / tmu.NUM_BYTES_IN_MEGABYTE
        formula = "without SP (x1.05)"
    out.append({"weights_optimizer": weights, "activation": act, "total": weights + act, "formula": formula})
print(json.dumps(out))
"""


def megatron(cases: tuple[Case, ...] = CASES) -> list[dict[str, float]]:
    """Megatron's estimates (MiB), computed in a subprocess (megatron imports take ~15 s)."""
    payload = json.dumps([megatron_args(c) for c in cases])
    proc = subprocess.run(
        [sys.executable, "-c", _MEGATRON_SIDE],
        input=payload,
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"megatron side failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def comparison(cases: tuple[Case, ...] = CASES) -> list[dict[str, object]]:
    rows = []
    for case, theirs in zip(cases, megatron(cases), strict=True):
        mine = ours(case)
        rows.append(
            {
                "case": case.label,
                "formula": theirs["formula"],
                **{f"ours_{k}": mine[k] for k in ("weights_optimizer", "activation", "total")},
                **{f"megatron_{k}": theirs[k] for k in ("weights_optimizer", "activation", "total")},
                **{
                    f"diff_{k}": (mine[k] - theirs[k]) / theirs[k] for k in ("weights_optimizer", "activation", "total")
                },
            }
        )
    return rows


def markdown(rows: list[dict[str, object]]) -> str:
    lines = [
        "| case (rank 0, selective recompute, bf16) | Megatron activation formula | weights+grads+optimizer "
        "ours / Megatron (MiB) | activations ours / Megatron (MiB) | total ours / Megatron (MiB) | total diff |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        w = f"{r['ours_weights_optimizer']:.0f} / {r['megatron_weights_optimizer']:.0f}"
        a = f"{r['ours_activation']:.0f} / {r['megatron_activation']:.0f}"
        t = f"{r['ours_total']:.0f} / {r['megatron_total']:.0f}"
        lines.append(
            f"| {r['case']} | {r['formula']} | {w} ({100 * r['diff_weights_optimizer']:+.2f}%) "
            f"| {a} ({100 * r['diff_activation']:+.2f}%) | {t} | {100 * r['diff_total']:+.2f}% |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(comparison()))
