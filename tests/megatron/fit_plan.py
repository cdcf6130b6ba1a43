"""Many ``forge fit`` runs in a few worker launches: one per process count (``checkpoint_worker.py``).

A test module lists its runs as plan steps (:func:`fit_step`); :func:`run_plan` launches all steps of one process
count in one ``torch.distributed.run`` of ``checkpoint_worker.py``, each step with its own output file, and the
tests read the runs through :class:`PlanRuns`: a run that failed (or never ran) fails the test that reads it, with
its error and its output's tail, and no other.

A launch that dies during a step (a crash, the worker's watchdog) is started again with the steps after it, so one
run that takes its processes down still fails only its own tests.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conftest import free_port

HERE = Path(__file__).resolve().parent
WATCHDOG_S = 120  # seconds any one step may take (checkpoint_worker.py's watchdog; a step takes 1-5 s)
TAIL = 5000  # characters of each rank's output in a failure's message


def fit_step(name: str, args: list[str], *, nproc: int, expect_error: bool = False) -> dict:
    """A plan step: ``ForgeCLI(args)`` (``args`` from ``fit`` on, ``--trainer.devices`` included) on ``nproc``
    processes; its CSV logger must be named ``name`` (``--trainer.logger.init_args.name``)."""
    step = {"name": name, "args": list(args), "nproc": nproc}
    if expect_error:
        step["expect_error"] = True
    return step


class PlanRuns:
    """The results of a plan's runs: ``root`` is their working directory (``runs/tests/<name>`` their metrics)."""

    def __init__(self, root: Path, nproc: dict[str, int], results: dict[str, dict]):
        self.root, self._nproc, self._results = root, nproc, results

    def _output(self, name: str) -> str:
        parts = []
        for rank in range(self._nproc[name]):
            log = self.root / "logs" / f"{name}.rank{rank}.log"
            text = log.read_text(errors="replace") if log.is_file() else "(no output)"
            parts.append(f"----- {name}, rank {rank} of {self._nproc[name]}: {log}\n{text[-TAIL:]}")
        return "\n".join(parts)

    def _result(self, name: str) -> dict:
        assert name in self._nproc, f"{name!r} is not a step of the plan"
        result = self._results.get(
            name, {"error": "no result (the plan stopped before this run)", "left": []}
        )
        assert not result.get("left"), f"run {name} left {result['left']}\n{self._output(name)}"
        return result

    def rows(self, name: str) -> list[dict[str, str]]:
        """The metrics.csv rows of run ``name``, which must have succeeded."""
        result = self._result(name)
        assert result["error"] is None, f"run {name} failed: {result['error']}\n{self._output(name)}"
        return list(
            csv.DictReader((self.root / "runs" / "tests" / name / "version_0" / "metrics.csv").open())
        )

    def error(self, name: str) -> str:
        """The error of run ``name``, which must have failed (a step with ``expect_error``)."""
        result = self._result(name)
        assert result["error"] is not None, f"run {name} did not fail\n{self._output(name)}"
        return result["error"]


def _launch(root: Path, nproc: int, plan: list[dict], attempt: int) -> dict[str, dict]:
    """One worker launch of ``plan``: the results of the steps that every rank finished, then of the step during
    which the launch died, if it did."""
    for name in (f"results_{nproc}_rank{rank}.json" for rank in range(nproc)):
        (root / name).unlink(missing_ok=True)
    plan_file = root / f"plan_{nproc}_{attempt}.json"
    plan_file.write_text(json.dumps(plan, indent=1))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env |= {"OMP_NUM_THREADS": "1", "WATCHDOG_S": str(WATCHDOG_S)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-port", str(free_port()), str(HERE / "checkpoint_worker.py"), str(plan_file)]
    log = root / f"launch_{nproc}_{attempt}.log"
    with log.open("w") as out:
        try:
            proc = subprocess.run(
                cmd,
                cwd=root,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=WATCHDOG_S * len(plan) + 120,
            )
            status = f"exit code {proc.returncode}"
            ok = proc.returncode == 0
        except subprocess.TimeoutExpired:
            status, ok = "timed out", False
    ranks = []
    for rank in range(nproc):
        path = root / f"results_{nproc}_rank{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.is_file() else {})
    results = {}
    for step in plan:
        name = step["name"]
        if not all(name in r for r in ranks):
            break
        errors = [f"rank {rank}: {r[name]['error']}" for rank, r in enumerate(ranks) if r[name]["error"]]
        results[name] = {
            "error": ranks[0][name]["error"] or (errors[0] if errors else None),
            "seconds": max(r[name]["seconds"] for r in ranks),
            "left": sorted({x for r in ranks for x in r[name]["left"]}),
        }
    launch_log = log.read_text(errors="replace")
    if not ok and len(results) == len(plan):  # every run done, then the launch failed: each run reports it
        for result in results.values():
            result["error"] = (
                result["error"] or f"the worker launch ended badly ({status}): {launch_log[-TAIL:]}"
            )
    elif not ok or len(results) < len(plan):
        name = plan[len(results)]["name"]
        results[name] = {"error": f"the worker launch ended during this run ({status}): {launch_log[-TAIL:]}"}
        results[name]["left"] = []
    return results


def _run_count(root: Path, count: int, plan: list[dict]) -> dict[str, dict]:
    """The steps of one process count: one launch, or, after a launch that died during a step, another one for the
    steps after it."""
    results: dict[str, dict] = {}
    attempt = 0
    while plan:
        start = time.perf_counter()
        done = _launch(root, count, plan, attempt)
        results |= done
        print(
            f"fit plan: {len(done)} of {len(plan)} runs on {count} processes, {time.perf_counter() - start:.1f} s"
        )
        plan, attempt = plan[len(done) :], attempt + 1
    return results


def run_plan(root: Path, steps: list[dict]) -> PlanRuns:
    """Run ``steps`` (from :func:`fit_step`) in ``root``: one worker launch per process count, in the steps' order.

    The launches of different process counts run at the same time (the machine's cores are not all busy in either
    alone), so a step must not read what a step of another process count writes."""
    names = [s["name"] for s in steps]
    assert len(set(names)) == len(names), f"run names repeat: {names}"
    (root / "logs").mkdir(parents=True, exist_ok=True)
    plans: dict[int, list[dict]] = {}
    for s in steps:
        step = {
            "name": s["name"],
            "args": s["args"],
            "log": str(root / "logs" / f"{s['name']}.rank{{rank}}.log"),
        }
        plans.setdefault(s["nproc"], []).append(
            step | ({"expect_error": True} if s.get("expect_error") else {})
        )
    results: dict[str, dict] = {}
    with ThreadPoolExecutor(max(1, len(plans))) as pool:
        for done in pool.map(lambda item: _run_count(root, *item), plans.items()):
            results |= done
    return PlanRuns(root, {s["name"]: s["nproc"] for s in steps}, results)
