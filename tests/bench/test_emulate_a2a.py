"""Emulated all-to-alls (``bench --emulate --a2a-ms``): the communication-side pad, on a fake clock (single
process, deterministic): an overlapped pair's all-to-alls elapse under the other side's compute, exactly as
the simulator's CPU launch model times them; not overlapped, they pad their ops."""

from __future__ import annotations

import argparse
import random

import pytest

from megatron_pp_ext.analysis.moe_comm import COMM, MoeComm, pair_nodes, pair_time, timed_nodes
from megatron_pp_ext.bench import emulate_bench, emulate_report, emulate_results
from megatron_pp_ext.bench.emulate_a2a import A2APads, CommStream, play_pair
from megatron_pp_ext.cli import main
from megatron_pp_ext.schedules import generate


class FakeClock:
    """A clock that only a sleep (or a compute node's real work) moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _play(f: float, lf: int, b: float, lb: int, a: float, real: float = 0.0) -> tuple[FakeClock, CommStream, list]:
    clock = FakeClock()
    stream = CommStream(clock, clock.sleep)

    def compute(node: object) -> None:  # the op's real work takes part of its pad
        clock.now += real

    timeline = play_pair(pair_nodes(f, lf, b, lb, a), stream, compute)
    return clock, stream, timeline


def test_pair_by_hand_on_a_fake_clock() -> None:
    # F compute 4, B compute 8, one MoE layer, all-to-all 3, launched by the host (CPU):
    # B.combine 0-3 | F.attn 0-2 | B.experts 3-7 (waits B.combine) | F.dispatch launched at 7: 7-10 |
    # B.dispatch 10-13 (stream busy) | F.experts 10-12 | F.combine 13-16 | B.attn 13-17
    clock, stream, timeline = _play(4, 1, 8, 1, 3)
    got = [(f"{n.side}.{n.name}", start, end) for n, start, end in timeline]
    assert got == [
        ("B.combine", 0, 3),
        ("F.attn", 0, 2),
        ("B.experts", 3, 7),
        ("F.dispatch", 7, 10),
        ("B.dispatch", 10, 13),
        ("F.experts", 10, 12),
        ("F.combine", 13, 16),
        ("B.attn", 13, 17),
    ]
    assert clock.now == 17 == pair_time(4, 1, 8, 1, 3, host_launch=True)
    assert clock.now < (4 + 6) + (8 + 6)  # the ops one after the other, all-to-alls padded on
    # order, not timing: every all-to-all is launched before the other side's next compute and waited for after it
    events = [(what, name) for what, name, _ in stream.events]
    assert events.index(("launch", "B.combine")) < events.index(("waited", "B.combine"))
    assert events == [
        ("launch", "B.combine"),
        ("waited", "B.combine"),
        ("launch", "F.dispatch"),
        ("launch", "B.dispatch"),
        ("waited", "F.dispatch"),
        ("launch", "F.combine"),
        ("waited", "B.dispatch"),
        ("waited", "F.combine"),
    ]


def test_played_pairs_match_the_simulators_cpu_launch_model() -> None:
    rng = random.Random(3)
    for _ in range(300):
        f, b, a = rng.uniform(0.5, 6), rng.uniform(0.5, 9), rng.uniform(0, 4)
        lf, lb = rng.randint(0, 3), rng.randint(0, 3)
        clock, _, timeline = _play(f, lf, b, lb, a, real=0.0)
        model = timed_nodes(pair_nodes(f, lf, b, lb, a), host_launch=True)
        assert [x for _, s, e in timeline for x in (s, e)] == pytest.approx([x for _, s, e in model for x in (s, e)])
        assert clock.now == pytest.approx(pair_time(f, lf, b, lb, a, host_launch=True))
        assert clock.now <= f + b + 2 * (lf + lb) * a + 1e-9
        assert pair_time(f, lf, b, lb, a) <= clock.now + 1e-9  # streams issued ahead (GPU) never later


def test_comm_stream_pads_from_the_launch_and_queues() -> None:
    clock = FakeClock()
    stream = CommStream(clock, clock.sleep)
    first = stream.launch("x", 5.0)
    clock.now = 2.0
    second = stream.launch("y", 1.0)  # the stream is busy until 5
    assert (first, second) == (5.0, 6.0)
    clock.now = 7.0
    stream.wait("x", first)  # already over: no sleep
    assert clock.now == 7.0
    nodes = [n for n in pair_nodes(2, 1, 2, 1, 1) if n.stream == COMM]
    assert len(nodes) == 4


def test_serial_pads() -> None:
    pads = A2APads(0.003, (2, 0, 1))
    assert pads.serial_s("F", 0) == pytest.approx(0.012)
    assert pads.serial_s("BW", 2) == pytest.approx(0.006)
    assert pads.serial_s("B", 1) == 0.0
    assert pads.serial_s("W", 0) == 0.0


def _settings(*flags: str) -> emulate_bench.Settings:
    parser = argparse.ArgumentParser()
    parser.add_argument("-p", dest="p_list", default=None)
    parser.add_argument("--m-factors", default=None)
    parser.add_argument("--write", default=None)
    parser.add_argument("--plots", default=None)
    emulate_bench.add_arguments(parser)
    settings = emulate_bench.settings_from(parser.parse_args(list(flags)))
    assert settings is not None
    return settings


def test_bench_pads_and_simulates_the_all_to_alls() -> None:
    flags = ("--emulate", "-p", "2", "-m", "4", "--costs", "20,20,10,1", "--a2a-ms", "3", "--moe-layers", "2")
    settings = _settings(*flags)
    assert (settings.a2a_ms, settings.moe_layers) == (3.0, 2)
    assert "--a2a-ms 3 --moe-layers 2" in settings.command
    for name, k in (("1f1b", 1), ("v-min", 2)):
        schedule = generate(name, 2, 4)
        costs = emulate_bench.stage_costs(settings, schedule, 1.0)
        job = emulate_bench._job(settings, schedule, costs)
        extra = 2 * 2 * 3.0 / k / 1000  # two all-to-alls per MoE layer, 1/k of a 1F1B stage's layers per stage
        for kind, base in (("F", 20), ("B", 20), ("W", 10), ("BW", 30)):
            want = base / k / 1000 + (0.0 if kind == "W" else extra)
            assert job.pads_s[kind] == pytest.approx((want,) * schedule.num_stages), (name, kind)
        moe = emulate_bench.moe_comm(settings, schedule)
        assert moe == MoeComm(3.0 / k, 2, host_launch=True)
    outcome = emulate_results.Outcome(settings, 1.0, None, [], {}, (0.0, 0.0), 1.0)
    assert "MoE all-to-alls: 3 ms each, 2 MoE layer(s) per 1F1B stage" in emulate_report.report(outcome, None)
    plain = _settings("--emulate", "-p", "2", "-m", "4")
    assert emulate_bench.moe_comm(plain, generate("1f1b", 2, 4)) is None


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--emulate", "--moe-layers", "2"], "--moe-layers: only with --a2a-ms"),
        (["--emulate", "--a2a-ms", "400", "--moe-layers", "2"], "--a2a-ms x 2 x --moe-layers must be in [0, 1000]"),
        (["--a2a-ms", "2"], "--a2a-ms: only with --emulate"),
    ],
)
def test_bench_a2a_refusals(capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    assert main(["bench", *flags]) == 2
    assert message in capsys.readouterr().err
