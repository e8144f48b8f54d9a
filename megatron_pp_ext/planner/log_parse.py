"""One Megatron training log -> :class:`RunLog`: what ``megatron-pp collect`` reads from each ``*.log``.

Reads the files ``grid`` and ``launch-local`` write (first line ``# megatron-pp config ID``, last line
``# megatron-pp exit code N``; plain Megatron logs work too, named by their file stem) and what
``megatron.training`` prints:

* the iteration line of ``training_log`` (printed by the last rank)::

     [2026-01-01 10:00:00.123456] iteration       10/      20 | consumed samples: 1280 |
     elapsed time per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 123.4 |
     learning rate: 1.000000E-04 | global batch size:   128 | lm loss: 6.543210E+00 | ...

* ``report_memory``'s ``[Rank R] (after N iterations) memory (MB) | allocated: ... | max allocated:
  ... | reserved: ... | max reserved: ...`` (per data-parallel-rank-0 process),
* ``Theoretical memory footprints: weight and optimizer=... MB, activation=... MB, total=... MB``,
* the timers block ``(min, max) time across ranks (ms):`` (``--timing-log-option minmax``).

A run is ``ok`` when it logged its last iteration, megatron's end-of-training line
(``[after training is done]``) and exited 0 (a log whose last line is cut off is never ``ok``:
that partial line is ignored and the run counts as ``incomplete``), ``exit-error`` when it trained
every iteration (megatron printed ``[after training is done]``) but the process then exited
non-zero (its measurements stand), ``oom`` when the log shows a CUDA / torch out-of-memory error,
``timeout`` for a Slurm time limit, ``failed`` for another error or a non-zero exit code,
``incomplete`` when it stopped without saying why (still running or killed); ``collect`` adds
``missing`` for a planned configuration without a log.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .files import MAX_LOG_BYTES, read_capped

__all__ = ["MEASURED", "RunLog", "parse_log"]

_ITER = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_FIELDS = {
    "elapsed_ms": re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.eE+-]+)"),
    "tflops": re.compile(r"throughput per GPU \(TFLOP/s/GPU\):\s*([0-9.eE+-]+)"),
    "loss": re.compile(r"lm loss:\s*([0-9.eE+-]+|nan|inf)", re.IGNORECASE),
    "global_batch": re.compile(r"global batch size:\s*(\d+)"),
    "consumed": re.compile(r"consumed samples:\s*(\d+)"),
    "skipped": re.compile(r"number of skipped iterations:\s*(\d+)"),
    "nan": re.compile(r"number of nan iterations:\s*(\d+)"),
}
_MEMORY = re.compile(
    r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| max allocated: ([0-9.]+)"
    r" \| reserved: ([0-9.]+) \| max reserved: ([0-9.]+)"
)
_THEORY = re.compile(
    r"Theoretical memory footprints: weight and optimizer=([0-9.]+) MB, activation=([0-9.]+) MB, total=([0-9.]+) MB"
)
_TIMER = re.compile(r"^\s+([A-Za-z0-9_-][A-Za-z0-9 _./-]*?) \.+: \(([0-9.]+), ([0-9.]+)\)\s*$")
_HEADER = re.compile(r"^# megatron-pp config (\S+)")
_EXIT = re.compile(r"^# megatron-pp exit code (-?\d+)")
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|out of memory", re.IGNORECASE)
_TIMEOUT = re.compile(r"DUE TO TIME LIMIT|CANCELLED AT .* DUE TO TIME", re.IGNORECASE)
_ERROR_LINE = re.compile(r"^(?:\[[^\]]*\]:?\s*)?([A-Za-z_][A-Za-z0-9_.]*(?:Error|Exception)\b.*)$")


MEASURED = ("ok", "exit-error")  # statuses whose iteration times are complete


@dataclass
class RunLog:
    """What one log says."""

    path: Path
    config_id: str
    iterations: list[dict[str, float]] = field(default_factory=list)
    memory: dict[int, tuple[float, float, float, float]] = field(default_factory=dict)  # rank -> MB
    theoretical: tuple[float, float, float] | None = None  # weights+optimizer, activation, total (MB)
    timers: dict[str, tuple[float, float]] = field(default_factory=dict)  # last (min, max) ms per timer
    exit_code: int | None = None
    oom: bool = False
    timeout: bool = False
    error: str | None = None
    args: str | None = None
    done: bool = False  # megatron printed "[after training is done]"
    truncated: bool = False  # the file ends in the middle of a line (that line is ignored)

    @property
    def train_iters(self) -> int | None:
        return int(self.iterations[-1]["of"]) if self.iterations else None

    @property
    def status(self) -> str:
        if self.oom:
            return "oom"
        if self.timeout:
            return "timeout"
        finished = bool(self.iterations) and self.iterations[-1]["iteration"] >= self.iterations[-1]["of"]
        if finished and self.done and self.exit_code not in (None, 0):
            return "exit-error"  # trained every iteration, then the process exited abnormally
        if (self.exit_code not in (None, 0)) or (self.error and not finished):
            return "failed"
        if finished and self.done and self.exit_code in (None, 0) and not self.truncated:
            return "ok"  # megatron's end-of-training line too: a log cut short is never "ok"
        return "incomplete"


def parse_log(path: str | Path) -> RunLog:
    p = Path(path)
    text = read_capped(p, MAX_LOG_BYTES, "log")
    run = RunLog(path=p, config_id=p.stem)
    wrapper_error = False
    lines = text.splitlines()
    if text and not text.endswith(("\n", "\r")):
        run.truncated = True  # cut mid-line: a cut "75.27" would read as "7"
        lines = lines[:-1]
    for line in lines:
        header = _HEADER.match(line)
        if header:
            run.config_id = header.group(1)
            continue
        if line.startswith("# args:"):
            run.args = line[len("# args:") :].strip()
            continue
        if line.startswith("[after training is done]"):
            run.done = True
            continue
        code = _EXIT.match(line)
        if code:
            run.exit_code = int(code.group(1))
            continue
        it = _ITER.search(line)
        if it and "elapsed time per iteration" in line:
            entry: dict[str, float] = {"iteration": float(it.group(1)), "of": float(it.group(2))}
            for key, rx in _FIELDS.items():
                match = rx.search(line)
                if match:
                    try:
                        entry[key] = float(match.group(1))
                    except ValueError:
                        entry[key] = float("nan")
            run.iterations.append(entry)
            continue
        mem = _MEMORY.search(line)
        if mem:
            rank = int(mem.group(1))
            values = tuple(float(mem.group(i)) for i in range(3, 7))
            old = run.memory.get(rank)
            run.memory[rank] = values if old is None else tuple(max(a, b) for a, b in zip(old, values, strict=True))  # type: ignore[assignment]
            continue
        theory = _THEORY.search(line)
        if theory:
            run.theoretical = (float(theory.group(1)), float(theory.group(2)), float(theory.group(3)))
            continue
        timer = _TIMER.match(line)
        if timer:
            run.timers[timer.group(1).strip()] = (float(timer.group(2)), float(timer.group(3)))
            continue
        if _OOM.search(line):
            if not run.oom:
                run.error = line.strip()[:300]  # the out-of-memory message says most
            run.oom = True
        if _TIMEOUT.search(line):
            run.timeout = True
            run.error = run.error or line.strip()[:300]
        if line.startswith("terminate called") and (run.error is None or wrapper_error):
            run.error, wrapper_error = line.strip()[:300], False  # a C++ abort (SIGABRT)
            continue
        err = _ERROR_LINE.match(line.strip())
        if err and not run.oom and "Warning" not in err.group(1).split(":")[0]:
            text = err.group(1)[:300]
            # torchrun's wrapper exceptions only repeat a failure reported above them: keep the
            # first real exception, a wrapper only if there is nothing else.
            wrapper = text.startswith(("torch.distributed.elastic", "ChildFailedError"))
            if run.error is None or (wrapper_error and not wrapper):
                run.error, wrapper_error = text, wrapper
    return run
