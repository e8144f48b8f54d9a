"""ZeroPP (issue 15): simulated iteration time, bubble, exposed FSDP time, gathers and memory of ``zeropp``
vs ``bfs``, ``bfs-zb``, ``1f1b`` and ``zb-h1`` with FSDP, for a GPT preset on 8-32 GPUs; U swept.

Cost assumptions (all from megatron_pp_ext.planner, no measurement):

* model ``zb-6.2b`` (30 layers, hidden 4096, seq 1024), micro-batch 1, bf16, A100-80GB preset, TP = 1;
  per-layer ``T_F, T_B, T_W`` from :class:`~megatron_pp_ext.planner.costs.CostModel` (ms); a stage of
  ``L / (p v)`` layers costs that many layers (fractional layers allowed: an idealisation that ignores
  the embedding and output layer, which the planner would place on the first and last stage);
  ``t_comm`` = the planner's p2p hop time.
* FSDP over ``dp`` ranks per stage across nodes (a pipeline packed into a node, its data-parallel peers on
  other nodes): the network's ``inter_gbps`` per GPU; a chunk's all-gather and gradient reduce-scatter move
  its bf16 parameters (``L/(p v)`` layers x 201M parameters x 2 bytes).
  ``zeropp`` reduce-scatters each chunk's gradients once per scheduling unit (its declared policy:
  ``v ceil(m/U)`` per rank and iteration, column "reduce-scatters / iter"), the others once per chunk.
* memory (worst rank) = peak live activations from the simulator (``layer_activation_bytes`` per layer and
  micro-batch, an activation held from F until its W) + the FSDP chunks gathered at once (the schedule's
  declared limit x one chunk's bf16 parameters). The sharded parameter, gradient and optimizer state
  (1/dp of the rank's) is the same for every schedule and left out.

    PYTHONPATH=. python benchmarks/bench_zeropp.py
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pp_ext.analysis.simulate import Costs, simulate
from megatron_pp_ext.analysis.validate import validate
from megatron_pp_ext.analysis.zeropp_auto import choose_unit_size
from megatron_pp_ext.planner.costs import CostModel, get_device
from megatron_pp_ext.planner.memory import TrainingSetup, layer_activation_bytes, parameter_counts
from megatron_pp_ext.planner.models import get_model
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.collectives import CollectiveKind, declared_fsdp_limit, policy_for
from megatron_pp_ext.schedules.schedule import Schedule

MODEL, DEVICE, MICRO_BATCH = "zb-6.2b", "A100-80GB", 1
SETTINGS = ((4, 2, 16), (8, 2, 32), (8, 4, 32))  # (p, dp, m): 8, 16 and 32 GPUs


@dataclass
class Row:
    name: str
    v: int
    unit: str
    time: float
    bubble: float
    exposed: float
    gathers: int
    reduces: int  # gradient reduce-scatters per iteration, worst rank (zeropp: per chunk and unit)
    memory: float  # GB


class Setting:
    def __init__(self, p: int, dp: int, m: int) -> None:
        model = get_model(MODEL)
        device = get_device(DEVICE)
        setup = TrainingSetup()
        cost = CostModel(model, device, setup)
        self.p, self.dp, self.m = p, dp, m
        self.layer = cost.layer_times(MICRO_BATCH, 1, "none")  # seconds
        self.t_comm = cost.p2p_time(MICRO_BATCH, 1, p, dp) * 1e3
        self.layers = model.num_layers
        self.layer_params = parameter_counts(model).layer
        self.layer_act = layer_activation_bytes(model, MICRO_BATCH, 1, setup)
        self.bandwidth = device.inter_gbps * 1e6  # bytes per ms

    def costs(self, v: int) -> Costs:
        per = self.layers / (self.p * v) * 1e3  # ms per layer-second x layers per stage
        return Costs(self.layer.f * per, self.layer.b * per, self.layer.w * per, None, self.t_comm)

    def chunk_bytes(self, v: int) -> float:
        return self.layers / (self.p * v) * self.layer_params * 2

    def run(self, schedule: Schedule, label: str) -> Row:
        v = schedule.chunks_per_rank
        costs = self.costs(v)
        lowered = validate(schedule)
        plain = simulate(schedule, costs, lowered=lowered)
        policy = policy_for(schedule, fsdp=True)
        result = simulate(
            schedule,
            costs,
            lowered=lowered,
            collectives=policy,
            dp=self.dp,
            dp_bandwidth=self.bandwidth,
            param_bytes=self.chunk_bytes(v),
        )
        data = result.data_parallel
        assert data is not None
        act = max(plain.peak_activations) * self.layers / (self.p * v) * self.layer_act
        limit = declared_fsdp_limit(schedule) or 1
        gathered = min(limit, v) * self.chunk_bytes(v)
        return Row(
            schedule.name,
            v,
            label,
            data.iteration_time,
            plain.sync_bubble_rate,
            max(data.exposed),
            max(data.plan.count(CollectiveKind.UNSHARD, r) for r in range(self.p)),
            max(data.reduction_count(r) for r in range(self.p)),
            (act + gathered) / 1e9,
        )


def table(setting: Setting, rows: list[Row], base: dict[str, Row]) -> None:
    print(
        "| schedule | v | U | iteration (ms) | vs 1f1b | vs best bfs | bubble (compute) | exposed FSDP (ms) "
        "| gathers / iter | reduce-scatters / iter | memory (GB) | <= 1f1b memory |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r.name} | {r.v} | {r.unit} | {r.time:.1f} | {base['1f1b'].time / r.time:.2f}x | "
            f"{base['bfs'].time / r.time:.2f}x | {r.bubble:.3f} | {r.exposed:.1f} | {r.gathers} | {r.reduces} | "
            f"{r.memory:.1f} | "
            f"{'yes' if r.memory <= base['1f1b'].memory + 1e-9 else 'no'} |"
        )


def main() -> None:
    print(f"model {MODEL}, micro-batch {MICRO_BATCH}, {DEVICE}, FSDP over the network; see the module doc\n")
    for p, dp, m in SETTINGS:
        s = Setting(p, dp, m)
        print(
            f"\n#### p={p} x dp={dp} = {p * dp} GPUs, m={m}, t_comm={s.t_comm:.3f} ms, "
            f"layer F/B/W = {s.layer.f * 1e3:.2f}/{s.layer.b * 1e3:.2f}/{s.layer.w * 1e3:.2f} ms\n"
        )
        rows = [s.run(generate("1f1b", p, m), "-"), s.run(generate("zb-h1", p, m), "-")]
        for v in (2, 4):
            rows += [s.run(generate("bfs", p, m, v=v), "m"), s.run(generate("bfs-zb", p, m, v=v), "m")]
        base = {"1f1b": rows[0], "bfs": min((r for r in rows if r.name.startswith("bfs")), key=lambda r: r.time)}
        sweep, capped = [], []
        for v in (2, 4):
            for unit in [u for u in range(1, m + 1) if m % u == 0]:
                sweep.append(s.run(generate("zeropp", p, m, v=v, unit_size=unit, costs=s.costs(v)), str(unit)))
        for v in (2, 4):  # activations capped at 1F1B's (p M_a): a unit of U needs U M_a
            for unit in [u for u in range(1, p + 1) if m % u == 0]:
                schedule = generate("zeropp", p, m, v=v, unit_size=unit, costs=s.costs(v), memory_limit=p)
                capped.append(s.run(schedule, f"{unit}, act <= p"))
        table(s, rows + sweep + capped, base)
        for v in (2, 4):  # auto: memory budget = 1F1B's, FSDP costs
            auto_line(s, p, m, v, sweep + capped, base)


def auto_line(s: Setting, p: int, m: int, v: int, rows: list[Row], base: dict[str, Row]) -> None:
    """``unit_size="auto"`` under 1F1B's memory, and whether its pick is on the time/memory frontier."""
    choice = choose_unit_size(
        p,
        m,
        v=v,
        costs=s.costs(v),
        dp=s.dp,
        dp_bandwidth=s.bandwidth,
        param_bytes=s.chunk_bytes(v),
        fsdp=True,
        activation_bytes=s.layers / (p * v) * s.layer_act,
        memory_budget=base["1f1b"].memory * 1e9,
    )
    best = choice.best
    points = [(r.unit, r.time, r.memory) for r in rows if r.v == v]
    points += [(f"{c.unit_size} (auto cap)", c.iteration_time, (c.memory_bytes or 0) / 1e9) for c in choice.candidates]
    frontier = [pt for pt in points if not any(o[1] < pt[1] and o[2] <= pt[2] for o in points if o is not pt)]
    on = any(pt[0] == f"{best.unit_size} (auto cap)" for pt in frontier)
    print(
        f"\nauto (v={v}, memory budget = 1f1b's {base['1f1b'].memory:.1f} GB): U={best.unit_size}, "
        f"{best.iteration_time:.1f} ms ({base['1f1b'].time / best.iteration_time:.2f}x 1f1b), "
        f"{(best.memory_bytes or 0) / 1e9:.2f} GB. Time/memory frontier of every v={v} zeropp point above and "
        "auto's candidates: "
        + ", ".join(f"U={u} ({t:.1f} ms, {mem:.2f} GB)" for u, t, mem in sorted(frontier, key=lambda x: x[1]))
        + f"; auto's pick on the frontier: {'yes' if on else 'no'}"
    )
    print("\n```\n" + choice.table() + "\n```")


if __name__ == "__main__":
    main()
