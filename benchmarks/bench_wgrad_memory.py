"""Memory of the B/W split for one transformer layer (megatron-core local spec, fp32, CPU ranks).

For one micro-batch: the bytes the layer's forward saves for backward (what an
unsplit backward frees at once), the bytes the weight-gradient store holds
between B and W (layer inputs and output gradients of the deferred linears),
and under sequence parallelism the all-gather volume W adds by re-gathering the
linears' inputs. For whole layers also the memory model's figures (``planner.memory``:
``wgrad_held_bytes`` = M_W, ``layer_activation_bytes`` = M_B, their ratio the ``--w-memory``
the planner derives; fp32, unfused attention, no dropout, as the probe's model).

    python benchmarks/bench_wgrad_memory.py
"""

from __future__ import annotations

from megatron_pp_ext.planner.memory import TrainingSetup, layer_activation_bytes, wgrad_held_bytes
from megatron_pp_ext.planner.models import ModelSpec
from megatron_pp_ext.selfcheck.split_check import LayerMemoryCase, layer_memory_probe
from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.rank_run import TrainingRankPool


def model_figures(case: LayerMemoryCase) -> tuple[float, float]:
    """``(M_W, M_B)`` bytes of the memory model for the probe's layer (rank 0's share)."""
    spec = ModelSpec("probe", 1, case.hidden, case.heads, case.seq, hidden_dropout=0.0, attention_dropout=0.0)
    setup = TrainingSetup(precision="fp32", sequence_parallel=case.sequence_parallel, attention="unfused")
    return wgrad_held_bytes(spec, case.batch, case.tp, setup), layer_activation_bytes(spec, case.batch, case.tp, setup)


def main() -> None:
    cases = [
        LayerMemoryCase(tp=1),
        LayerMemoryCase(tp=2),
        LayerMemoryCase(tp=2, module="mlp"),
        LayerMemoryCase(tp=2, sequence_parallel=True, module="mlp"),
    ]
    print(
        "| module (s=128, b=2, h=256, fp32; rank 0) | TP | SP | saved for backward (B+W) | held by the store B->W "
        "| held / saved | all-gather in B | all-gather in W | all-gather, unsplit backward "
        "| model: M_W | model: M_B | model: M_W / M_B |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with TrainingRankPool(2) as pool:
        for case in cases:
            results = pool.run_fn(layer_memory_probe, case, case.tp, 300)
            check_errors(results)
            r = results[0]
            name = "transformer layer" if case.module == "layer" else "MLP"
            held, kept = model_figures(case)
            model = (
                f"| {held / 2**10:.0f} KiB | {kept / 2**10:.0f} KiB | {held / kept:.2f} |"
                if case.module == "layer"
                else "| - | - | - |"
            )
            print(
                f"| {name} | {case.tp} | {'on' if case.sequence_parallel else 'off'} "
                f"| {r['saved_activation_bytes'] / 2**10:.0f} KiB | {r['store_held_bytes'] / 2**10:.0f} KiB "
                f"| {r['store_held_bytes'] / r['saved_activation_bytes']:.2f} "
                f"| {r['all_gather_bytes_in_b'] / 2**10:.0f} KiB | {r['all_gather_bytes_in_w'] / 2**10:.0f} KiB "
                f"| {r['all_gather_bytes_unsplit_backward'] / 2**10:.0f} KiB {model}"
            )


if __name__ == "__main__":
    main()
