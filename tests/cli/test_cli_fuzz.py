"""Fuzzing the command line: flag values and file contents drawn by hypothesis, each case run in a forked
child under a memory limit (``RLIMIT_AS``: what the process holds now plus :data:`MEMORY_BYTES`) and a time
limit (``alarm``), must end with status 0, or with a clean error: status 1 or 2, no Python traceback, and
one error line. A request that the code does not bound (a number that sizes a loop or an allocation, a file
read without a cap) dies of the limits here and fails the test, so CI finds the next one, not a user.

Integers are drawn from small values (valid or just invalid) and from huge ones (>= 10**6, beyond every
bound): a value in between is a legitimate request that may take seconds, which is not what this looks for.
Commands that start processes (``verify``, ``launch-local``) are left out; their bounds are tested on their own.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from megatron_pp_ext.cli import main
from megatron_pp_ext.schedules import registry

MEMORY_BYTES = 512 << 20  # growth allowed per case: a bounded refusal needs a few MB
CPU_S = 20  # CPU seconds per case (RLIMIT_CPU: the same verdict on a loaded machine); a refusal takes < 0.1 s
WALL_S = 600  # a backstop for a case that blocks without using CPU (a read that waits forever)
FUZZ = settings(
    max_examples=10,
    deadline=None,  # the per-case limits (CPU_S, WALL_S) are enforced in the child
    derandomize=True,  # the same cases on every run and machine (CI is deterministic)
    database=None,
    phases=(Phase.explicit, Phase.generate),  # no shrinking: a failing case is reported as drawn, at once
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _address_space() -> int:
    with open("/proc/self/status") as stream:
        for line in stream:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


def run_limited(argv: list[str], workdir: Path) -> tuple[int, str]:
    """``main(argv)`` in a forked child under the limits: ``(status, stderr)``; a signal is ``-signal``."""
    err_path = workdir / "stderr.txt"
    limit = _address_space() + MEMORY_BYTES
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 3
        try:
            out = os.open(os.devnull, os.O_WRONLY)
            err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(err, 2)
            sys.stdout = open(1, "w", closefd=False)  # pytest's capture objects stand in for them here
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            os.chdir(workdir)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            resource.setrlimit(resource.RLIMIT_CPU, (CPU_S, CPU_S + 5))  # SIGXCPU, then SIGKILL
            signal.signal(signal.SIGXCPU, signal.SIG_DFL)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(WALL_S)
            try:
                code = int(main(argv) or 0)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except MemoryError:
                os.write(2, b"Traceback: MemoryError (over the fuzz memory limit)\n")
                code = 4
            except BaseException:
                import traceback

                os.write(2, ("Traceback\n" + traceback.format_exc()).encode())
                code = 5
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code)
    _, status, usage = os.wait4(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if os.environ.get("MEGATRON_PP_FUZZ_TIMES"):  # to size the examples: CPU seconds per case
        print(f"{usage.ru_utime + usage.ru_stime:.2f} s CPU: {' '.join(argv)[:160]}", file=sys.__stderr__)
    return code, err_path.read_text(errors="replace") if err_path.exists() else ""


def check(argv: list[str], workdir: Path) -> None:
    code, err = run_limited(argv, workdir)
    what = f"megatron-pp {' '.join(argv)}"
    assert code not in (-signal.SIGXCPU, -signal.SIGKILL), f"{what}: over {CPU_S} CPU seconds (unbounded work?)"
    assert code != -signal.SIGALRM, f"{what}: blocked for {WALL_S} s (a read without an end?)"
    assert code >= 0, f"{what}: killed by signal {-code}\n{err[-2000:]}"
    assert "Traceback" not in err, f"{what}: {err[-3000:]}"
    assert code in (0, 1, 2), f"{what}: status {code}\n{err[-2000:]}"
    if code:
        lines = [line for line in err.splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower() or line.startswith("INVALID")]
        assert len(errors) == 1, f"{what}: expected one error line, got:\n{err[-2000:]}"


# Huge first: hypothesis starts from the first branch, so the few examples per flag always try one.
NUMBER = st.one_of(
    st.integers(10**6, 10**30).map(str),
    st.integers(-2, 12).map(str),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "1.5", "", "abc", "0x10", " 3", "1_0"]),
)
SCHEDULES = [*sorted(registry.names()), "no-such-schedule"]


SIMULATE_FLAGS: dict[str, st.SearchStrategy[str]] = {
    "-p": NUMBER,
    "-m": NUMBER,
    "-v": NUMBER,
    "--iterations": NUMBER,
    "--costs": st.lists(NUMBER, min_size=1, max_size=5).map(",".join),
    "--memory-limit": st.one_of(NUMBER, NUMBER.map(lambda x: x + "p")),
    "--step-time": NUMBER,
    "--pipeline-unit-size": st.one_of(NUMBER, st.just("auto")),
    "--microbatch-group-size": NUMBER,
    "--w-memory": NUMBER,
    "--overlap": NUMBER,
    "--dp": NUMBER,
    "--param-bytes": NUMBER,
}


@pytest.mark.parametrize("flag", sorted(SIMULATE_FLAGS))
@settings(FUZZ, max_examples=3)
@given(data=st.data())
def test_simulate_flag_values(flag: str, data: st.DataObject) -> None:
    """A valid request (so that nothing else refuses it first) with a drawn value for one flag."""
    name = data.draw(st.sampled_from(["1f1b", "zb-h1", "interleaved-1f1b", "v-half", "zeropp", "zb-auto"]))
    argv = {"-p": "4", "-m": "8"}
    if flag in ("--dp", "--param-bytes"):
        argv.update({"--dp": "2", "--dp-bandwidth": "100", "--param-bytes": "1G"})
    argv[flag] = data.draw(SIMULATE_FLAGS[flag])
    with tempfile.TemporaryDirectory() as tmp:
        check(["simulate", name, *(x for item in argv.items() for x in item)], Path(tmp))


@given(argv=st.lists(st.sampled_from(sorted(SIMULATE_FLAGS)), max_size=4, unique=True).flatmap(
    lambda flags: st.tuples(st.sampled_from(SCHEDULES), *(SIMULATE_FLAGS[f] for f in flags)).map(
        lambda values: ["simulate", values[0], *(x for f, v in zip(flags, values[1:], strict=True) for x in (f, v))]
    )
))  # fmt: skip
@FUZZ
def test_simulate_any_flags(argv: list[str]) -> None:
    """Any schedule name with several drawn flags at once."""
    with tempfile.TemporaryDirectory() as tmp:
        check(argv, Path(tmp))


CELL = st.one_of(
    st.tuples(st.sampled_from(["F", "B", "W", "BW", "X", ""]), NUMBER, NUMBER).map(lambda t: f"{t[0]}{t[1]}.{t[2]}"),
    st.text(max_size=8),
)
LINE = st.one_of(
    st.tuples(NUMBER, st.lists(CELL, max_size=6)).map(lambda t: ",".join([t[0], *t[1]])),
    st.tuples(st.sampled_from(["microbatches", "chunks", "placement", "replicas", "name"]), NUMBER).map(
        lambda t: f"# {t[0]}={t[1]}"
    ),
)


@st.composite
def schedule_file(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=200))
    head = "# megatron_pp_ext schedule v1\n" if draw(st.booleans()) else ""
    return (head + "\n".join(draw(st.lists(LINE, max_size=8))) + "\n").encode()


@FUZZ
@given(content=schedule_file(), collectives=st.booleans())
def test_validate_file_contents(content: bytes, collectives: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.csv"
        path.write_bytes(content)
        check(["validate", str(path), *(["--collectives"] if collectives else [])], Path(tmp))
        check(["simulate", "--schedule-file", str(path)], Path(tmp))


SMALL_LISTS = st.lists(st.integers(-1, 9).map(str), min_size=1, max_size=3).map(",".join)
PLAN_FLAGS: dict[str, st.SearchStrategy[str]] = {
    "--gpus": NUMBER,
    "--global-batch": NUMBER,
    "--pp": st.one_of(SMALL_LISTS, NUMBER),
    "--micro-batch": st.one_of(SMALL_LISTS, NUMBER),
    "--top": NUMBER,
    "--memory-budget": NUMBER,
    "--unit-sizes": st.one_of(SMALL_LISTS, NUMBER),
}


@pytest.mark.parametrize("flag", sorted(PLAN_FLAGS))
@settings(FUZZ, max_examples=3)
@given(data=st.data())
def test_plan_flag_values(flag: str, data: st.DataObject) -> None:
    argv = ["plan", "--model", "tiny", "--no-cache", "--schedules", "1f1b,zb-h1,zeropp", flag]
    with tempfile.TemporaryDirectory() as tmp:
        check([*argv, data.draw(PLAN_FLAGS[flag])], Path(tmp))


LOG_LINE = st.one_of(
    st.tuples(NUMBER, NUMBER, NUMBER).map(
        lambda t: (
            f" [2026-01-01] iteration {t[0]}/ {t[1]} | elapsed time per iteration (ms): {t[2]} | "
            f"global batch size: {t[0]} | lm loss: {t[1]} | TFLOP/s/GPU: {t[2]} |"
        )
    ),
    st.tuples(NUMBER).map(lambda t: f"[Rank 0] (after {t[0]} iterations) memory (MB) | max allocated: {t[0]}"),
    st.text(max_size=40),
)


@settings(FUZZ, max_examples=10)
@given(log=st.lists(LOG_LINE, max_size=10).map("\n".join), plan=st.one_of(st.text(max_size=60), st.none()))
def test_collect_file_contents(log: str, plan: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp) / "logs"
        logs.mkdir()
        (logs / "1f1b-t1p2d1-b1m4-v1-none.log").write_text(log)
        argv = ["collect", str(logs), "--no-plot", "--out", str(Path(tmp) / "out")]
        if plan is not None:
            (Path(tmp) / "plan.json").write_text(plan)
            argv += ["--plan", str(Path(tmp) / "plan.json")]
        check(argv, Path(tmp))
