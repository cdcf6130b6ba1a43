"""What the benchmark scripts share: the step timer, peak memory, TFLOP/s and MFU, the ratio and table cells, the
results JSON, and running a child process (or a torchrun launch) and reading its result line.

Each throughput script measures every path in a child process of its own (clean peak memory and compile caches)
and prints one markdown table last::

    parent                                        child (``--child PATH``; under torchrun, every rank)
    run_child(cmd) ─────────────────────────────▶ timer = StepTimer(warmup, steps, cuda)
                                                  after each step: timer.after_step(steps done)
    ChildRun.result() ◀── "RESULT {json}" line ── emit_result({"tokens_per_s": timer.rate(tokens per step),
                                                                "peak_mem_gb": peak_memory_gb(cuda), ...})
    write_json(out, {"meta": run_meta(...), ...}); print(markdown_table(columns, rows))

Only the standard library is imported at module level (torch where a function needs it): the lerobot side of
``vla_throughput.py`` may run in another interpreter, without forge_lightning.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
# The scripts' folder goes last on the import path: its kernels.py would shadow the `kernels` package (Hugging Face
# kernels) that diffusers and transformers import when it is installed. The scripts' own modules still import.
_HERE = os.path.realpath(os.path.dirname(__file__))
_OTHERS = [p for p in sys.path if os.path.realpath(p or ".") != _HERE]
if len(_OTHERS) < len(sys.path):
    sys.path[:] = [*_OTHERS, _HERE]
# Dense bf16 peak of the H200 (the same as the H100 SXM's): the denominator of every MFU the benchmarks report.
PEAK_TFLOPS = 989.0
T = TypeVar("T")


# ----- timing and memory ------------------------------------------------------------------------------------
class StepTimer:
    """Wall time of ``steps`` steps after ``warmup`` untimed ones, between two device-synchronised points.

    Call :meth:`after_step` after every step with the number of steps done (and once with 0 before the first,
    which starts the clock when ``warmup`` is 0). When ``warmup`` steps are done the timer synchronises the
    device, resets CUDA's peak-memory counter and starts the clock (``time.perf_counter``); when ``warmup +
    steps`` are done it synchronises again and stops. The steps in between are not synchronised (the host runs
    ahead as in training); their boundaries are marked with CUDA events on the GPU (created before the clock
    starts, so a mark only records one) and ``perf_counter`` on the CPU, which give each step's own time
    (:attr:`step_times_s`, :attr:`median_step_s`).

    Args:
        warmup: untimed steps before the clock starts.
        steps: timed steps.
        cuda: whether the steps run on a CUDA device.
    """

    def __init__(self, warmup: int, steps: int, cuda: bool) -> None:
        self.warmup, self.steps, self.cuda = warmup, steps, cuda
        self._start_s: float | None = None
        self._end_s: float | None = None
        self._marks: list[Any] = []  # the boundaries so far: recorded CUDA events, or perf_counter seconds
        self._events: list[Any] = []  # CUDA: an event for every boundary, created when the clock starts

    def after_step(self, done: int) -> None:
        """Starts, marks or stops the clock once ``done`` steps are done (other counts do nothing).

        Args:
            done: steps done so far, warm-up included.
        """
        if done == self.warmup:
            self._start()
        elif self._end_s is None and self._marks and self.warmup < done <= self.warmup + self.steps:
            self._mark()
            if done == self.warmup + self.steps:
                self._stop()

    @property
    def elapsed_s(self) -> float:
        """Seconds from the end of the warm-up to the end of the last timed step."""
        self._check_stopped()
        return self._end_s - self._start_s

    @property
    def step_s(self) -> float:
        """Mean seconds per timed step."""
        return self.elapsed_s / self.steps

    @property
    def step_times_s(self) -> list[float]:
        """Seconds of each timed step (on the GPU, between the CUDA events that mark its ends)."""
        self._check_stopped()
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self._marks, self._marks[1:])]
        return [b - a for a, b in zip(self._marks, self._marks[1:])]

    @property
    def median_step_s(self) -> float:
        """Median seconds per timed step."""
        return statistics.median(self.step_times_s)

    def rate(self, per_step: float) -> float:
        """Items (tokens, samples) per second when each timed step processes ``per_step`` of them.

        Args:
            per_step: items one timed step processes (e.g. micro-batch x sequence length).
        """
        return per_step * self.steps / self.elapsed_s

    def _start(self) -> None:
        if self.cuda:
            import torch

            self._events = [torch.cuda.Event(enable_timing=True) for _ in range(self.steps + 1)]
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._start_s, self._end_s, self._marks = time.perf_counter(), None, []
        self._mark(self._start_s)

    def _mark(self, now_s: float | None = None) -> None:
        if self.cuda:
            event = self._events[len(self._marks)]
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter() if now_s is None else now_s)

    def _stop(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self._end_s = time.perf_counter()
        else:
            self._end_s = self._marks[-1]

    def _check_stopped(self) -> None:
        if self._start_s is None or self._end_s is None:
            raise RuntimeError(
                f"StepTimer: {max(0, len(self._marks) - 1)} of {self.steps} timed steps (after {self.warmup} "
                "warm-up steps) ran"
            )


def run_steps(step: Callable[[T], object], inputs: Sequence[T], warmup: int, cuda: bool) -> StepTimer:
    """Runs ``step`` on each of ``inputs`` in order, the first ``warmup`` untimed, and returns the stopped timer.

    Args:
        step: one training step (or call) on one input.
        inputs: one input per step, warm-up steps included.
        warmup: untimed steps at the start.
        cuda: whether the steps run on a CUDA device.
    """
    timer = StepTimer(warmup, len(inputs) - warmup, cuda)
    timer.after_step(0)
    for done, item in enumerate(inputs, 1):
        step(item)
        timer.after_step(done)
    return timer


def peak_memory_bytes(cuda: bool) -> float:
    """Peak memory: CUDA's ``max_memory_allocated`` since the last reset (:class:`StepTimer` resets it when the
    clock starts), or on the CPU this process's peak resident set size.

    Args:
        cuda: whether to read the CUDA allocator's peak (else the process's resident peak).
    """
    if cuda:
        import torch

        return float(torch.cuda.max_memory_allocated())
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def peak_memory_gb(cuda: bool) -> float:
    """:func:`peak_memory_bytes` in GB (1e9 bytes).

    Args:
        cuda: whether to read the CUDA allocator's peak (else the process's resident peak).
    """
    return peak_memory_bytes(cuda) / 1e9


# ----- throughput -------------------------------------------------------------------------------------------
def tflops(flops_per_s: float) -> float:
    """TFLOP/s of a rate in FLOP/s (e.g. tokens/s x FLOPs per token).

    Args:
        flops_per_s: model FLOPs per second.
    """
    return flops_per_s / 1e12


def mfu(tflops: float) -> float:
    """Model FLOPs utilisation: a fraction of :data:`PEAK_TFLOPS`.

    Args:
        tflops: achieved TFLOP/s (per GPU).
    """
    return tflops / PEAK_TFLOPS


# ----- table cells ------------------------------------------------------------------------------------------
def reference_row(
    rows: Iterable[Mapping[str, Any]], keep: Callable[[Mapping[str, Any]], bool]
) -> Mapping[str, Any] | None:
    """The first row that did not fail and that ``keep`` accepts (``None`` if there is none).

    Args:
        rows: result rows; a failed one has an ``error`` key.
        keep: which rows may serve as the reference.
    """
    return next((r for r in rows if "error" not in r and keep(r)), None)


def best(
    rows: Iterable[Mapping[str, Any]], key: str, keep: Callable[[Mapping[str, Any]], bool]
) -> float | None:
    """The highest ``row[key]`` among the rows that did not fail and that ``keep`` accepts (``None`` if none).

    Args:
        rows: result rows; a failed one has an ``error`` key.
        key: the value compared (e.g. ``tokens_per_s_per_gpu``).
        keep: which rows take part.
    """
    return max((r[key] for r in rows if "error" not in r and keep(r)), default=None)


def ratio(value: float | None, reference: float | None) -> str:
    """``value / reference`` as ``1.23x``; ``-`` where either is missing (a path that failed or did not run) or
    the reference is zero.

    Args:
        value: this row's value (e.g. tokens/s).
        reference: the reference row's value.
    """
    return f"{value / reference:.2f}x" if value is not None and reference else "-"


def change(value: float, reference: float | None) -> str:
    """Relative difference from ``reference`` as ``+1.23%`` (e.g. of a mean loss); ``-`` without a reference.

    Args:
        value: this row's value.
        reference: the reference row's value, or ``None``.
    """
    return f"{100 * (value / reference - 1):+.2f}%" if reference else "-"


def failed(error: str, width: int = 100) -> str:
    """The table cell of a path that failed: its error message, cut to ``width`` characters.

    Args:
        error: the error message (one line).
        width: characters of it to keep.
    """
    return f"failed: {error[:width]}"


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: the header, the separator and one line per row (a failed path's row may be shorter).

    Args:
        columns: the column names.
        rows: the cells of each row, already formatted (anything else goes through ``str``).
    """
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


# ----- the results JSON -------------------------------------------------------------------------------------
def command_line(script: str | Path, argv: Sequence[str] | None = None) -> str:
    """The command that runs ``script`` with ``argv``: ``python benchmarks/x.py ARGS``, quoted for a shell.

    Args:
        script: the benchmark script (its path is given relative to the repository when inside it).
        argv: its arguments (default: this process's ``sys.argv[1:]``).
    """
    path = Path(script).resolve()
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return shlex.join(["python", str(shown), *(sys.argv[1:] if argv is None else argv)])


def machine(cuda: bool) -> str:
    """The device the numbers were measured on: the GPU's name, or ``cpu``.

    Args:
        cuda: whether the run used the CUDA device.
    """
    if not cuda:
        return "cpu"
    import torch

    return torch.cuda.get_device_name()


def run_meta(script: str | Path, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The command line that produced a result (``command``, and ``argv`` as a list) and the torch version.

    Args:
        script: the benchmark script.
        argv: its arguments (default: this process's ``sys.argv[1:]``).
    """
    import torch

    args = list(sys.argv[1:] if argv is None else argv)
    return {"command": command_line(script, args), "argv": args, "torch": torch.__version__}


def write_json(path: str | Path, record: Mapping[str, Any]) -> Path:
    """Writes ``record`` as indented JSON (creating the folder); a reader never sees a half-written file.

    Args:
        path: the output file.
        record: the results and their ``meta``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(partial, path)
    return path


# ----- child processes --------------------------------------------------------------------------------------
def emit(line: str) -> None:
    """Prints one line in one write: the ranks of a torchrun launch share its stdout pipe, and ``print`` may write
    text and newline separately, letting another rank's line land between (a pipe write under 4 KiB is atomic).

    Args:
        line: the text, without its newline.
    """
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def emit_result(result: Mapping[str, Any]) -> None:
    """Prints the child's result as its ``RESULT {json}`` line (:meth:`ChildRun.result` reads it).

    Args:
        result: the measured row.
    """
    emit("RESULT " + json.dumps(result))


@contextlib.contextmanager
def errors_reported() -> Iterator[None]:
    """Re-raises any exception of the block after printing ``ERROR <type>: <first line>``, the line the parent
    reports for the launch (:meth:`ChildRun.failure`) instead of the launcher's own last words."""
    try:
        yield
    except BaseException as error:
        emit(f"ERROR {type(error).__name__}: {error}".splitlines()[0])
        raise


def torchrun(nproc: int, script: str | Path, args: Sequence[str]) -> list[str]:
    """The command line of a one-node ``torch.distributed.run`` launch of ``script`` on ``nproc`` processes.

    Args:
        nproc: processes (GPUs) on this node.
        script: the script every process runs.
        args: its arguments.
    """
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*run, str(script), *args]


@dataclass
class ChildRun:
    """What a child process printed, its exit status and how long it ran."""

    stdout: str
    stderr: str
    returncode: int
    seconds: float

    def result(self) -> dict[str, Any] | None:
        """The JSON of the first ``RESULT`` line, or ``None``. Searched anywhere in a line: another rank's
        unterminated output may precede it."""
        found = re.findall(r"RESULT (\{.*\})$", self.stdout, flags=re.MULTILINE)
        return json.loads(found[0]) if found else None

    def failure(self) -> str:
        """Prints the tail of the output to stderr and returns one line saying why the child failed: its first
        ``ERROR`` line, else its last line, else its exit status."""
        tail = (self.stdout + self.stderr).strip()
        print(tail[-3000:], file=sys.stderr, flush=True)
        errors = [line.removeprefix("ERROR ") for line in tail.splitlines() if line.startswith("ERROR ")]
        if errors:
            return errors[0]
        return tail.splitlines()[-1] if tail else f"exit {self.returncode}"


def run_child(
    cmd: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    timeout_message: str = "killed after {:.0f} s",
) -> ChildRun:
    """Runs ``cmd`` in a process group of its own and collects its output; past ``timeout`` seconds (or on an
    interrupt) the whole group is stopped.

    Args:
        cmd: the command line.
        env: its environment (default: this process's).
        timeout: seconds before it is stopped (``None``: no limit).
        timeout_message: the ``ERROR`` line added to its stderr when stopped, formatted with ``timeout``.
    """
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop(proc)
        stderr += "\nERROR " + timeout_message.format(timeout)
    except BaseException:  # e.g. Ctrl-C: the child's group does not get the terminal's SIGINT
        _stop(proc)
        raise
    return ChildRun(stdout, stderr, proc.returncode, time.perf_counter() - started)


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM to the child's process group (torchrun stops its ranks, each in a session of its own, on it), then
    SIGKILL to what is left after a minute; returns the output."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


# ----- the forge-fit rows -------------------------------------------------------------------------------------
FIT_WINDOW = 5
"""Steps per ``ThroughputMonitor`` window of the ``forge-fit`` rows; their first window is warm-up."""


def fit_steps(steps: int) -> tuple[int, int]:
    """``(max_steps, timed_steps)`` of a ``forge-fit`` row: one warm-up window, then whole windows covering ``steps``."""
    timed = FIT_WINDOW * max(1, -(-steps // FIT_WINDOW))
    return FIT_WINDOW + timed, timed


def single_device_trainer(trainer: dict[str, Any], *, cuda: bool, work: Path, max_steps: int) -> None:
    """A recipe's ``trainer`` section changed, in place, into a ``forge-fit`` row's: one device, ``max_steps``,
    no checkpoints, its logger under ``work / "run"`` and ``ThroughputMonitor`` as the only callback."""
    trainer.update(devices=1, max_steps=max_steps, max_epochs=None, default_root_dir=str(work / "run"))
    trainer.update(accelerator="gpu" if cuda else "cpu", log_every_n_steps=1, enable_checkpointing=False)
    trainer["logger"]["init_args"]["save_dir"] = str(work / "run")
    trainer["callbacks"] = [
        {"class_path": "forge_lightning.callbacks.ThroughputMonitor", "init_args": {"window": FIT_WINDOW}}
    ]


def fit_metrics(metrics_csv: str | Path) -> dict[str, Any]:
    """What a ``forge fit`` run's ``ThroughputMonitor`` logged: the means over its windows of ``throughput/*``,
    the last window's ``memory/peak_gb``, and the logged ``train/loss`` values.

    Args:
        metrics_csv: the run's ``CSVLogger`` ``metrics.csv``.

    Raises:
        RuntimeError: the file holds no throughput window (the run was too short for one).
    """
    metrics_csv = Path(metrics_csv)
    with metrics_csv.open() as f:
        rows = list(csv.DictReader(f))
    windows = [r for r in rows if r.get("throughput/tokens_per_sec")]
    if not windows:
        raise RuntimeError(f"{metrics_csv} holds no throughput window: train longer (--steps)")

    def mean(key: str) -> float:
        return sum(float(r[key]) for r in windows) / len(windows)

    return {
        "tokens_per_s": mean("throughput/tokens_per_sec"),
        "samples_per_s": mean("throughput/samples_per_sec"),
        "tflops": mean("throughput/tflops_per_device")
        if windows[0].get("throughput/tflops_per_device")
        else 0.0,
        "step_s": mean("throughput/step_time_s"),
        "data_wait_pct": mean("throughput/data_wait_pct"),
        "peak_mem_gb": float(windows[-1]["memory/peak_gb"]),
        "windows": len(windows),
        "losses": [float(r["train/loss"]) for r in rows if r.get("train/loss")],
    }


def forge_fit(recipe: str | Path, work: str | Path) -> tuple[list[str], dict[str, Any]]:
    """Runs ``python -m forge_lightning fit --config recipe`` in ``work`` (this repository first on
    ``PYTHONPATH``), keeps its output in ``work/fit.log`` and reads its :func:`fit_metrics` from the
    ``metrics.csv`` under ``work/run`` (the recipe's logger must write there; an earlier run's is removed first).

    Args:
        recipe: the recipe YAML, already changed for the benchmark.
        work: the run's folder.

    Returns:
        The command line and the measured metrics.

    Raises:
        RuntimeError: ``forge fit`` failed (its output's tail in the message), or logged no throughput window.
    """
    import shutil

    work = Path(work)
    shutil.rmtree(work / "run", ignore_errors=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "forge_lightning", "fit", "--config", str(recipe)]
    done = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True)
    (work / "fit.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"forge fit exited {done.returncode}: {(done.stdout + done.stderr)[-3000:]}")
    found = sorted((work / "run").rglob("metrics.csv"))
    if not found:
        raise RuntimeError(f"forge fit wrote no metrics.csv under {work / 'run'} (see {work / 'fit.log'})")
    return command, fit_metrics(found[0])
