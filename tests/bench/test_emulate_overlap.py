"""``megatron-pp bench --emulate --a2a-ms T --overlap-moe-expert-parallel-comm``: each schedule without and with
megatron's all-to-all overlap on a tiny MoE GPT at EP = 2; every dispatch and combine padded where it runs.

Deterministic: which thread ran each padded all-to-all (read from the ranks' records), the jobs' pads, the
pair accounting of the padded tracer, the rows and the refusals; never a wall-clock threshold.
"""

from __future__ import annotations

import time

import pytest

from megatron_pp_ext.analysis.overlap_order import overlap_order
from megatron_pp_ext.bench import emulate_bench, emulate_moe, emulate_report, emulate_results
from megatron_pp_ext.bench.emulate import PaddedTracer
from megatron_pp_ext.cli import main
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.ir import Op, OpKind
from tests.bench.test_emulate_a2a import _settings as parsed


def _overlap_settings(*extra: str) -> emulate_results.Settings:
    flags = ("--emulate", "-p", "2", "-m", "4", "--costs", "20,20,10,1", "--a2a-ms", "3", "--moe-layers", "2")
    return parsed(*flags, "--overlap-moe-expert-parallel-comm", *extra)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--emulate", "--overlap-moe-expert-parallel-comm"], "--overlap-moe-expert-parallel-comm: only with --a2a-ms"),
        (
            ["--emulate", "-p", "5", "--a2a-ms", "1", "--overlap-moe-expert-parallel-comm"],
            "-p with --overlap-moe-expert-parallel-comm must be in 2..4 (EP = 2: 2p ranks), got 5",
        ),
        (["--overlap-moe-expert-parallel-comm"], "--overlap-moe-expert-parallel-comm: only with --emulate"),
    ],
)
def test_overlap_refusals(capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    assert main(["bench", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_overlap_jobs_pad_nodes_and_all_to_alls_where_they_run() -> None:
    settings = _overlap_settings()
    assert settings.overlap and settings.ranks == 4
    assert settings.command.endswith("--overlap-moe-expert-parallel-comm")
    for name, k in (("1f1b", 1), ("v-zb", 2)):
        schedule = generate(name, 2, 4)
        costs = emulate_bench.stage_costs(settings, schedule, 1.0)
        (_, _, off), (marked, _, on) = emulate_bench.overlap_variants(settings, [(schedule, costs)])[0]
        assert (off, on) == (False, True) and any(marked.overlap_pairs)
        plain = emulate_bench._job(settings, schedule, costs)
        overlapped = emulate_bench._job(settings, marked, costs, on)
        for job in (plain, overlapped):  # a MoE model at EP = 2, 2 MoE layers per stage, each all-to-all 3 ms / k
            assert (job.ep, job.world_size, job.model.num_experts) == (2, 4, 4)
            assert job.model.num_layers == 2 * schedule.placement.stages_per_replica
            assert job.a2a_s == pytest.approx(0.003 / k)
        assert not plain.overlap_moe and overlapped.overlap_moe
        # an op outside a pair runs its all-to-alls inline, so its floor holds them, with or without overlap;
        # an overlapped pair is padded node by node (the tracer pads no pair then)
        assert plain.pads_s["F"][0] == pytest.approx((20 + 2 * 2 * 3) / k / 1000)
        assert overlapped.pads_s == plain.pads_s
        assert overlapped.pads_s["W"][0] == pytest.approx(0.010 / k)
        assert overlapped.node_pads_s["F"][0] == pytest.approx(0.020 / k / 4)  # half a layer's compute, 2 layers
        assert overlapped.node_pads_s["BW"][0] == pytest.approx(0.030 / k / 4)
        moe = emulate_bench.moe_comm(settings, marked, True)
        assert moe.overlap and moe.host_launch and moe.a2a == pytest.approx(3.0 / k)
    native = emulate_bench._job(settings, generate("interleaved-1f1b", 2, 4), costs, True)
    assert native.native == "interleaved-1f1b" and native.native_node_pads_s[1] == pytest.approx(0.030 / 2 / 4)
    assert emulate_bench._job(settings, generate("1f1b", 2, 4), costs, True).native is None  # megatron: VPP only
    variants, skipped = emulate_bench.overlap_variants(settings, [(generate("gpipe", 2, 4), costs)])
    assert len(variants) == 1 and "no steady state" in skipped["gpipe + overlap"]


def test_results_block_names_the_all_to_all_settings() -> None:
    plain = emulate_results.Settings(2, 4, ("1f1b",), 2, 1, 2.0, 2.0, 1.0, None)
    overlap = _overlap_settings()
    serial = parsed("--emulate", "-p", "2", "-m", "4", "--a2a-ms", "3", "--moe-layers", "2")
    names = {emulate_report.block_name(s) for s in (plain, overlap, serial)}
    assert len(names) == 3 and emulate_report.block_name(overlap) == "emulated p=2 m=4 a2a=3ms x2 overlap"


def test_padded_tracer_pads_a_pair_to_the_sum_of_its_ops() -> None:
    """A pair (both ops begun, then both ended, as the combined step does) lasts the sum of the two pads,
    is counted once in compute, and lists both ops with the pair's times."""
    pads = {"F": (0.004,), "B": (0.003,), "W": (0.002,), "BW": (0.005,)}
    tracer = PaddedTracer(0, pads)
    f, b = Op(OpKind.F, 0, 1), Op(OpKind.B, 0, 0)
    tracer.begin_iteration()
    tracer.begin_op(f)
    tracer.begin_op(b)
    tracer.end_op(b)
    tracer.end_op(f)
    time.sleep(0.001)
    tracer.end_iteration()
    (breakdown,) = tracer.breakdowns
    (_, n1, _, _, pad1, lasted1, start1), (_, n2, _, _, pad2, lasted2, start2) = tracer.ops
    assert (n1, n2) == (str(b), str(f)) and (pad1, pad2) == (0.003, 0.004)
    assert lasted1 == lasted2 >= 0.007 and start1 == start2
    assert breakdown["compute"] == pytest.approx(lasted1)


@pytest.mark.gloo
def test_padded_all_to_alls_run_on_the_comm_worker_only_with_overlap(pool) -> None:
    """p = 2, EP = 2 (4 ranks), 1f1b without and with overlap, one iteration: every padded dispatch and combine,
    forward and backward, ran inline on the main thread without overlap (ours and megatron's 1F1B) and on
    the CPU communication stream's worker with it; counted against the schedule."""
    settings = emulate_results.Settings(
        p=2,
        m=4,
        schedules=("1f1b",),
        iterations=1,
        warmup=0,
        t_f=2.0,
        t_b=2.0,
        t_w=1.0,
        comm_ms=0.5,
        a2a_ms=1.0,
        moe_layers=1,
        overlap=True,
        command="test",
    )
    outcome = emulate_bench.run_emulation(settings, pool, say=lambda text: None)
    assert [r.label for r in outcome.rows] == ["1f1b", "1f1b + overlap"]
    plain, overlapped = outcome.rows
    per_run = 4 * settings.m * 2 * 2  # 4 ranks, each micro-batch: dispatch and combine, forward and backward
    assert plain.native == "1f1b" and plain.a2a_on_worker == (0, 2 * per_run)  # ours and megatron's, inline
    # with overlap: those of the micro-batches with an op in a pair (their F and BW run as megatron's combined
    # steps) on the worker, the others inline (plain forward and backward steps)
    ordered = overlap_order(generate("1f1b", settings.p, settings.m))
    paired = sum(
        len({(row[j].stage, row[j].microbatch) for i in starts for j in (i, i + 1)})
        for row, starts in zip(ordered.ops, ordered.overlap_pairs, strict=True)
    )
    on_worker = 2 * paired * 2 * 2  # both data-parallel replicas; F and BW; dispatch and combine
    assert 0 < on_worker < per_run
    assert overlapped.native is None and overlapped.a2a_on_worker == (on_worker, per_run)
    assert overlapped.short_ops == 0 and overlapped.measured > 0 and overlapped.simulated > 0
    text = emulate_report.report(outcome)
    assert "| 1f1b + overlap | 1 |" in text and "All-to-all overlap" in text
    assert f"1f1b 0/{2 * per_run}, 1f1b + overlap {on_worker}/{per_run}" in text


def test_padded_tracer_leaves_an_overlapped_pair_to_its_node_pads() -> None:
    """With node pads (the overlapped run) a pair gets no floor of its own: its nodes carry the compute's pads
    and its all-to-alls run beside them; a lone op keeps its floor."""
    pads = {"F": (0.004,), "B": (0.003,), "W": (0.002,), "BW": (0.005,)}
    tracer = PaddedTracer(0, pads, node_pads=(emulate_moe.NodePads(), {"F": (0.0,), "B": (0.0,), "BW": (0.0,)}))
    f, b, lone = Op(OpKind.F, 0, 1), Op(OpKind.B, 0, 0), Op(OpKind.F, 0, 2)
    tracer.begin_iteration()
    tracer.begin_op(f)
    tracer.begin_op(b)
    tracer.end_op(b)
    tracer.end_op(f)
    tracer.begin_op(lone)
    tracer.end_op(lone)
    tracer.end_iteration()
    (_, _, _, _, pad1, lasted1, _), (_, _, _, _, pad2, _, _), (_, _, _, _, pad3, lasted3, _) = tracer.ops
    assert (pad1, pad2) == (0.0, 0.0) and lasted1 < 0.004
    assert pad3 == 0.004 and lasted3 >= 0.004
