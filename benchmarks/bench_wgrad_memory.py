"""Memory of the B/W split for one transformer layer (megatron-core local spec, fp32, CPU ranks).

For one micro-batch: the bytes the layer's forward saves for backward (what an
unsplit backward frees at once), the bytes the weight-gradient store holds
between B and W (layer inputs and output gradients of the deferred linears),
and under sequence parallelism the all-gather volume W adds by re-gathering the
linears' inputs.

    python benchmarks/bench_wgrad_memory.py
"""

from __future__ import annotations

from megatron_pp_ext.verification.selfcheck import LayerMemoryCase, layer_memory_probe
from megatron_pp_ext.verification.verify import RankPool, _check_errors


def main() -> None:
    cases = [
        LayerMemoryCase(tp=1),
        LayerMemoryCase(tp=2),
        LayerMemoryCase(tp=2, module="mlp"),
        LayerMemoryCase(tp=2, sequence_parallel=True, module="mlp"),
    ]
    print(
        "| module (s=128, b=2, h=256, fp32; rank 0) | TP | SP | saved for backward (B+W) | held by the store B->W "
        "| held / saved | all-gather in B | all-gather in W | all-gather, unsplit backward |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with RankPool(2) as pool:
        for case in cases:
            results = pool.run_fn(layer_memory_probe, case, case.tp, 300)
            _check_errors(results)
            r = results[0]
            name = "transformer layer" if case.module == "layer" else "MLP"
            print(
                f"| {name} | {case.tp} | {'on' if case.sequence_parallel else 'off'} "
                f"| {r['saved_activation_bytes'] / 2**10:.0f} KiB | {r['store_held_bytes'] / 2**10:.0f} KiB "
                f"| {r['store_held_bytes'] / r['saved_activation_bytes']:.2f} "
                f"| {r['all_gather_bytes_in_b'] / 2**10:.0f} KiB | {r['all_gather_bytes_in_w'] / 2**10:.0f} KiB "
                f"| {r['all_gather_bytes_unsplit_backward'] / 2**10:.0f} KiB |"
            )


if __name__ == "__main__":
    main()
