"""A planned layer layout on real ranks: a GPT whose output layer + loss is worth about six of its layers, on
2 CPU pipeline ranks (gloo, one thread each, megatron's own training loop through scripts/pretrain_gpt.py),
under 1f1b, zb-h1 and v-zb, each with the uniform split and with the layout the planner chooses from per-layer
costs measured on this machine.

The shape: 8 layers, hidden 256, 4 heads, sequence 128, micro-batch 1, 8 micro-batches per iteration,
vocabulary 40960, untied embeddings, no dropout, fp32. Per token a layer's forward is ``24 h^2 + 4 s h`` GEMM
FLOPs and the output layer's ``2 h V``, 12x as many; measured, with the layers' element-wise kernels and the
cross entropy over 40960 logits, the output layer + loss (``head``) is H ~ 6.6 layers' worth of F + B + W (a
layer ~17 ms, the head ~110 ms per micro-batch) and the embedding E ~ 0.75 (its backward writes the dense
40960 x 256 gradient). A layer's forward measures ~7 ms: its GEMMs ~2 ms at this core's ~110 GFLOP/s (one
thread), the rest element-wise kernels and megatron's Python; an op (a stage's layers) takes tens of ms, an
iteration ~1.5 s. The head is made this large so that the gains (~20%) stand well above this machine's
run-to-run spread (several percent between runs of one configuration).

What the layout gains, by hand (stage costs in layers' worth of F + B + W per micro-batch, m = 8, p2p free):

* 1f1b: uniform ``Etttt|ttttL`` has stages ``4 + E = 4.75 | 4 + H = 10.6``; the busy last stage runs its m
  micro-batches back to back between the first stage's first forward and last backward: ``~4.75 + 10.6 m =
  90``. Planned (the min-max partition) ``Ettttttt|tL``: ``7.75 | 7.6``, now the first stage is the bottleneck:
  ``~7.75 m + 7.6 = 70``. Gain ~23%.
* zb-h1: the same uniform bottleneck (``~90``: the deferred W fills the first stage's bubbles, not the last's);
  planned, the busy first stage waits only for about one F + B of the other (2/3 of it): ``7.75 m + 5 = 67``.
  Gain ~25%.
* v-zb (p = 2 gives 4 chunks, V-shaped: rank 0 holds stages 0 and 3, so the embedding and the loss sit on one
  rank): uniform ``Ett|tt|tt|ttL`` loads rank 0 with ``2 + E + 2 + H = 11.35`` and rank 1 with 4; v-zb has
  almost no bubble, so ``~11.35 m = 91``. Planned (the first/last family the V placement maps) ``E|tttt|tttt|L``:
  rank 0 ``E + H = 7.35``, rank 1 8: ``~8 m = 64`` plus the bubble a rank 1 twice as long as its chunks' peers
  leaves. Gain ~20-30%.

What the script does, in one command (prints its wall time; about 14 min at the defaults on a quiet 2-core
machine):

1. profiles: ``--profile-runs`` short v-zb runs of the uniform split with ``--pipeline-profile-out`` (its four
   stages hold embedding + 2 layers, 2, 2, 2 + head, which determines the per-kind times;
   schedules/kind_profile.py), giving per-layer-kind F, B, W (``dense``, ``embedding``, ``head``) and the
   measured p2p hop, and the time an iteration spends outside the pipeline (optimizer step, gradient norm,
   logging: megatron's iteration time less the traced forward-backward call), each the median over the runs;
2. plans: the planner (``--layer-split search``) with those costs (the ``CPU`` device preset's link latency set
   so its hop time is the measured one, its memory bandwidth so its optimizer step for the profiled
   configuration lasts the measured time outside the pipeline) predicts the iteration time of each schedule's
   uniform split and of its best planned layout; the runs get the plan's own flags (planner/megatron_args.py);
3. measures: ``--rounds`` interleaved rounds of the six runs, ``--iters`` iterations each (the first
   ``WARMUP`` dropped), traced (``--pipeline-trace``): per run the median iteration time megatron logs, the
   median forward-backward time and each rank's median busy time (time in compute ops; tracer summaries);
   medians over rounds;
4. prints the measured against the predicted times, gains and busy times, draws the per-rank busy times
   (uniform vs planned bars, predicted as ticks) to ``--plot``, and with ``--write`` replaces its block of
   benchmarks/RESULTS.md.

    PYTHONPATH=. python benchmarks/bench_layout_cpu.py [--rounds 4] [--iters 12] [--profile-runs 3] [--layer-costs TEXT]
        [--plot benchmarks/figures/layout_cpu_busy.png] [--write benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_pp_ext.analysis.plot import draw_rank_busy  # noqa: E402
from megatron_pp_ext.bench.results_file import write_block  # noqa: E402
from megatron_pp_ext.planner.cost_model import CostModel, get_device  # noqa: E402
from megatron_pp_ext.planner.layer_costs import MeasuredLayers  # noqa: E402
from megatron_pp_ext.planner.layer_layouts import layout_text  # noqa: E402
from megatron_pp_ext.planner.layout_runs import (  # noqa: E402
    TracedRun,
    agreement,
    gain,
    predicted_busy,
    read_trace,
)
from megatron_pp_ext.planner.log_parse import parse_log  # noqa: E402
from megatron_pp_ext.planner.megatron_args import config_args, model_args  # noqa: E402
from megatron_pp_ext.planner.memory import TrainingSetup  # noqa: E402
from megatron_pp_ext.planner.models import ModelSpec  # noqa: E402
from megatron_pp_ext.planner.result import PlanRow  # noqa: E402
from megatron_pp_ext.planner.search import Planner  # noqa: E402
from megatron_pp_ext.planner.space import SearchSpace  # noqa: E402
from megatron_pp_ext.schedules.kind_profile import layer_costs_text  # noqa: E402
from megatron_pp_ext.schedules.placement import make_placement  # noqa: E402
from megatron_pp_ext.schedules.values import parse_layer_costs  # noqa: E402

P, MICRO_BATCH, MICROBATCHES = 2, 1, 8
GLOBAL_BATCH = MICRO_BATCH * MICROBATCHES
VOCAB = 40960
WARMUP = 4  # iterations dropped from every run's medians (first-touch allocations, the first steps)
PROFILE_ITERS = 8  # profiled iterations (the median of each op drowns the first, slow ones)
SCHEDULES = ("1f1b", "zb-h1", "v-zb")
MODEL = ModelSpec(
    "layout-demo", 8, 256, 4, 128, vocab_size=VOCAB, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
    attention_dropout=0.0,
)  # fmt: skip
SETUP = TrainingSetup(precision="fp32", attention="unfused")
TRAIN_ARGS = [
    "--cpu", "--lr", "3e-4", "--lr-decay-style", "constant", "--eval-iters", "0", "--log-interval", "1",
    "--num-workers", "0",
]  # fmt: skip
BLOCK = "layout-cpu"
COMMAND = "PYTHONPATH=. python benchmarks/bench_layout_cpu.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pretrain(flags: list[str], iters: int, workdir: Path) -> Path:
    """One torchrun run of scripts/pretrain_gpt.py (2 ranks, one thread each); its log's path."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(P), "--master-port", str(free_port())]
    cmd += [str(REPO / "scripts" / "pretrain_gpt.py"), *TRAIN_ARGS, *model_args(MODEL), *flags]
    cmd += ["--train-iters", str(iters)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = workdir / "run.log"
    with log.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=900, check=False)
    if done.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"run failed (exit {done.returncode}): {shlex.join(cmd)}\n{tail}")
    return log


@dataclasses.dataclass(frozen=True)
class Profile:
    layer_costs: str  # KIND=F,B,W;... ms
    hop_s: float  # the measured p2p hop
    outside_s: float  # of an iteration, the time outside the pipeline (optimizer step, gradient norm, logging)


def profile(workdir: Path) -> Profile:
    """Per-layer-kind costs from one v-zb run's profile, its p2p hop, and the time its iterations after the
    warm-up spent outside the forward-backward call (megatron's logged iteration time less the traced step)."""
    out = workdir / "profile.json"
    flags = [
        "--pipeline-model-parallel-size", str(P), "--micro-batch-size", str(MICRO_BATCH),
        "--global-batch-size", str(GLOBAL_BATCH), "--pipeline-schedule", "v-zb",
        "--pipeline-profile-iters", str(PROFILE_ITERS), "--pipeline-profile-out", str(out),
        "--pipeline-trace", str(workdir / "trace"),
    ]  # fmt: skip
    log = pretrain(flags, PROFILE_ITERS + 1, workdir)
    doc = json.loads(out.read_text())
    if "layer_costs" not in doc:
        raise SystemExit(f"the profile {out} has no per-layer-kind costs: {doc}")
    times = [it["elapsed_ms"] for it in parse_log(log).iterations if it["iteration"] > WARMUP]
    outside = 1e-3 * statistics.median(times) - read_trace(workdir / "trace", P, WARMUP).step
    return Profile(str(doc["layer_costs"]), float(doc["t_comm"]), outside)


def median_profile(runs: int, workdir: Path) -> Profile:
    """The per-kind costs, hop and outside time of ``runs`` profiling runs, each entry the median over the
    runs: one short run takes whatever the machine was doing then (a run's ops all slower by 10% moves every
    prediction)."""
    profiles = []
    for i in range(runs):
        run_dir = workdir / f"profile{i}"
        run_dir.mkdir()
        profiles.append(profile(run_dir))
    parsed = [parse_layer_costs(p.layer_costs) for p in profiles]
    kinds = sorted(set.intersection(*(set(entries) for entries, _, _ in parsed)))
    times = {
        kind: tuple(1e-3 * statistics.median(entries[kind][i] for entries, _, _ in parsed) for i in range(3))
        for kind in kinds
    }
    _, micro_batch, tp = parsed[0]
    return Profile(
        layer_costs_text(times, micro_batch, tp),
        statistics.median(p.hop_s for p in profiles),
        statistics.median(p.outside_s for p in profiles),
    )


def planner(measured: Profile) -> Planner:
    """The layout search with the measured per-kind costs, the CPU preset's link latency fitted to the hop and,
    where the profile measured it, its memory bandwidth fitted so the optimizer step the planner predicts for
    the profiled configuration (v-zb, uniform split) lasts the time its runs spent outside the pipeline."""
    entries, micro_batch, tp = parse_layer_costs(measured.layer_costs)
    device = get_device("CPU")
    volume = MODEL.seq_length * MICRO_BATCH * MODEL.hidden_size * SETUP.activation_bytes
    latency_us = max(0.0, measured.hop_s - volume / (device.intra_gbps * 1e9)) * 1e6
    device = dataclasses.replace(device, intra_latency_us=latency_us)
    space = SearchSpace(
        tp=(1,), pp=(P,), micro_batch=(MICRO_BATCH,), recompute=("none",), schedules=SCHEDULES, virtual=(1,),
        layer_split="search",
    )  # fmt: skip
    layers = MeasuredLayers.from_ms(entries, micro_batch, tp)
    search = Planner(MODEL, P, GLOBAL_BATCH, CostModel(MODEL, device, SETUP), space=space, measured_layers=layers)
    if not measured.outside_s > 0:
        return search
    predicted = plan(search)[("v-zb", "uniform")].optimizer_time  # the step time is inverse in the bandwidth
    device = dataclasses.replace(device, hbm_gbps=device.hbm_gbps * predicted / measured.outside_s)
    return Planner(MODEL, P, GLOBAL_BATCH, CostModel(MODEL, device, SETUP), space=space, measured_layers=layers)


def plan(search: Planner) -> dict[tuple[str, str], PlanRow]:
    """The fastest row per (schedule, ``uniform`` / ``planned``); a schedule whose planned layout does not
    beat its uniform split gets the uniform row for both."""
    best: dict[tuple[str, str], PlanRow] = {}
    for row in search.run(progress=False).rows:
        key = (row.config.schedule, "planned" if row.config.layout else "uniform")
        if key not in best or row.iteration_time < best[key].iteration_time:
            best[key] = row
    for name in SCHEDULES:
        if (name, "uniform") not in best:
            raise SystemExit(f"the planner kept no uniform row of {name}")
        best.setdefault((name, "planned"), best[(name, "uniform")])
    return best


@dataclasses.dataclass
class Measured:
    iteration_ms: list[float] = dataclasses.field(default_factory=list)  # per round: median over iterations
    traces: list[TracedRun] = dataclasses.field(default_factory=list)

    @property
    def iteration(self) -> float:
        return statistics.median(self.iteration_ms)

    @property
    def step_ms(self) -> float:
        return 1e3 * statistics.median(t.step for t in self.traces)

    def busy_ms(self) -> list[float]:
        return [1e3 * statistics.median(t.busy[r] for t in self.traces) for r in range(P)]


def measure(row: PlanRow, iters: int) -> tuple[float, TracedRun]:
    """One traced run of a planned configuration: median iteration ms after the warm-up, the trace."""
    with tempfile.TemporaryDirectory(prefix="layout-cpu-") as tmp:
        work = Path(tmp)
        flags = [*config_args(row.config, SETUP, GLOBAL_BATCH), "--pipeline-trace", str(work / "trace")]
        log = pretrain(flags, iters, work)
        times = [it["elapsed_ms"] for it in parse_log(log).iterations if it["iteration"] > WARMUP]
        if not times:
            raise SystemExit(f"{row.config.schedule}: no iteration logged after the first {WARMUP}")
        return statistics.median(times), read_trace(work / "trace", P, WARMUP)


def shown(row: PlanRow) -> str:
    return layout_text(row.config.split).replace("|", "\\|")


def report(rows: dict[tuple[str, str], PlanRow], measured: dict[tuple[str, str], Measured], search: Planner) -> str:
    table = search.layer_table(MICRO_BATCH, 1, "none")
    lines = [
        "| schedule | layout | iteration ms: measured | predicted | forward-backward ms: measured | predicted "
        "| busy ms per rank: measured | predicted |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, kind in [(name, kind) for name in SCHEDULES for kind in ("uniform", "planned")]:
        row, got = rows[(name, kind)], measured[(name, kind)]
        placement = make_placement(row.config.placement, P)
        busy = predicted_busy(table, placement, row.config.split, MICROBATCHES)
        lines.append(
            f"| {name} | {kind} `{shown(row)}` | {got.iteration:.0f} | {1e3 * row.iteration_time:.0f} "
            f"| {got.step_ms:.0f} | {1e3 * row.pipeline_time:.0f} "
            f"| {' / '.join(f'{x:.0f}' for x in got.busy_ms())} | {' / '.join(f'{1e3 * x:.0f}' for x in busy)} |"
        )
    lines += [
        "",
        "| schedule | gain, iteration: measured | predicted | measured / predicted "
        "| gain, forward-backward: measured | predicted | measured / predicted |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in SCHEDULES:
        uni, pla = rows[(name, "uniform")], rows[(name, "planned")]
        mu, mp = measured[(name, "uniform")], measured[(name, "planned")]
        g_it, p_it = gain(mu.iteration, mp.iteration), gain(uni.iteration_time, pla.iteration_time)
        g_fb, p_fb = gain(mu.step_ms, mp.step_ms), gain(uni.pipeline_time, pla.pipeline_time)
        lines.append(
            f"| {name} | {100 * g_it:.1f}% | {100 * p_it:.1f}% | {agreement(g_it, p_it):.2f} "
            f"| {100 * g_fb:.1f}% | {100 * p_fb:.1f}% | {agreement(g_fb, p_fb):.2f} |"
        )
    return "\n".join(lines)


def plot(
    rows: dict[tuple[str, str], PlanRow], measured: dict[tuple[str, str], Measured], search: Planner, path: str
) -> Path:
    table = search.layer_table(MICRO_BATCH, 1, "none")
    panels = {}
    for name in SCHEDULES:
        panel = {}
        for kind in ("uniform", "planned"):
            row = rows[(name, kind)]
            placement = make_placement(row.config.placement, P)
            busy = [1e3 * x for x in predicted_busy(table, placement, row.config.split, MICROBATCHES)]
            panel[f"{kind} {layout_text(row.config.split)}"] = (measured[(name, kind)].busy_ms(), busy)
        panels[name] = panel
    title = f"busy time per rank, {P} gloo ranks, m={MICROBATCHES}: measured (bars), predicted (ticks)"
    return draw_rank_busy(panels, path, title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=12, help=f"iterations per run (the first {WARMUP} dropped)")
    parser.add_argument("--rounds", type=int, default=4, help="runs per configuration, interleaved")
    parser.add_argument("--layer-costs", help="per-kind costs (KIND=F,B,W;... ms) and skip the profiling run")
    parser.add_argument("--profile-runs", type=int, default=3, help="profiling runs, medians taken (default 3)")
    parser.add_argument("--hop-ms", type=float, default=0.5, help="p2p hop with --layer-costs (default 0.5)")
    parser.add_argument("--plot", default=str(REPO / "benchmarks" / "figures" / "layout_cpu_busy.png"))
    parser.add_argument("--write", metavar="RESULTS_MD", help=f"replace the {BLOCK!r} block of RESULTS_MD")
    args = parser.parse_args()
    if args.iters <= WARMUP or args.rounds < 1 or args.profile_runs < 1:
        parser.error(f"--iters must be > {WARMUP} (the warm-up), --rounds and --profile-runs >= 1")
    start, load = time.monotonic(), os.getloadavg()[0]
    if load > 0.5:  # the ranks need the cores to themselves: shared cores stretch ops and open idle gaps
        print(f"note: load average {load:.1f} at start: other jobs share the cores, timings will not be "
              "conclusive", file=sys.stderr, flush=True)  # fmt: skip
    if args.layer_costs:
        measured_profile = Profile(args.layer_costs, args.hop_ms * 1e-3, 0.0)
    else:
        with tempfile.TemporaryDirectory(prefix="layout-cpu-") as tmp:
            measured_profile = median_profile(args.profile_runs, Path(tmp))
    layer_costs, hop = measured_profile.layer_costs, measured_profile.hop_s
    search = planner(measured_profile)
    bandwidth = search.costs.device.hbm_gbps
    step = (
        f"outside the pipeline {1e3 * measured_profile.outside_s:.0f} ms per iteration (the CPU preset's memory "
        f"bandwidth fitted to it: {bandwidth:.2f} GB/s)"
        if measured_profile.outside_s > 0
        else f"the CPU preset's memory bandwidth ({bandwidth:.2f} GB/s) for the optimizer step"
    )
    print(f"per-layer-kind costs (ms): {layer_costs}; p2p hop {1e3 * hop:.2f} ms; {step}", flush=True)
    rows = plan(search)
    keys = sorted(rows)
    measured = {key: Measured() for key in keys}
    runs = args.rounds * len(keys)
    for r in range(args.rounds):
        for i in range(len(keys)):
            key = keys[(i + r) % len(keys)]  # rotate the order from round to round
            ms, trace = measure(rows[key], args.iters)
            measured[key].iteration_ms.append(ms)
            measured[key].traces.append(trace)
            done = r * len(keys) + i + 1
            print(f"[{done}/{runs}] {key[0]} {key[1]} {layout_text(rows[key].config.split)}: {ms:.0f} ms "
                  f"({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip
    text = report(rows, measured, search)
    figure = plot(rows, measured, search, args.plot)
    seconds = time.monotonic() - start
    source = "given" if args.layer_costs else f"medians of {args.profile_runs} profiling v-zb runs"
    about = (
        f"GPT of {MODEL.num_layers} layers, hidden {MODEL.hidden_size}, sequence {MODEL.seq_length}, vocabulary "
        f"{VOCAB} (untied), fp32, micro-batch {MICRO_BATCH}, {MICROBATCHES} micro-batches, {P} gloo ranks (one "
        f"thread each). Per-layer-kind costs (ms, {source}): "
        f"`{layer_costs}`; p2p hop {1e3 * hop:.2f} ms; {step}. {args.rounds} interleaved rounds of {args.iters} "
        f"iterations, the first {WARMUP} dropped; medians. Load average {load:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end; {seconds / 60:.1f} min in all."
    )
    print(f"\n{about}\n\n{text}\n\nfigure: {figure}\ntook {seconds:.0f} s ({seconds / 60:.1f} min)")
    if args.write:
        command = f"{COMMAND} --rounds {args.rounds} --iters {args.iters} --profile-runs {args.profile_runs}"
        command += f" --write {args.write}"
        try:
            shown_figure = figure.resolve().relative_to(Path(args.write).resolve().parent)
        except ValueError:
            shown_figure = figure
        body = f"Command: `{command}`\n\n{about}\n\n{text}\n\n![busy time per rank]({shown_figure})\n"
        write_block(args.write, BLOCK, body)
        print(f"wrote the {BLOCK!r} block of {args.write}")


if __name__ == "__main__":
    main()
