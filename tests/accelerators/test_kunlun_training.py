"""``forge fit`` on the simulated Kunlun runtime trains to the CPU run's losses, through the plugin's own code.

The quick-start recipe (configs/quickstart/llm.yaml, 10 steps) on 1 process; the tiny LLM
(tests/configs/tiny_llm.yaml) on 1 process, and on 2 processes under DDP and FSDP2 (each at the 1-process global
batch: the layouts' losses equal one process's, see tests/strategies/test_layouts.py); the tiny Pi0.5 VLA (``debug``
preset on the LeRobot fixture) on 1 process and on 2 under DDP and FSDP2. Every process logs the runtime, its device
and the process-group backend it chose; the assertions read those lines, so a run that fell back to Lightning's CPU
accelerator fails.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from procs import run_forge

REPO = Path(__file__).resolve().parents[2]
TINY_YAML = REPO / "tests" / "configs" / "tiny_llm.yaml"
FIXTURES = REPO / "tests" / "fixtures"
STEPS = [0, 1, 2, 3, 4]
KUNLUN = [
    "--trainer.accelerator=forge_lightning.accelerators.KunlunAccelerator",
    "--trainer.accelerator.runtime=simulated",
]


def _forge(args: list[str], cwd: Path) -> str:
    return run_forge(["fit", *args], cwd)


def _losses(metrics: Path) -> dict[int, float]:
    rows = list(csv.DictReader(metrics.open()))
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def _assert_same(losses: dict[int, float], reference: dict[int, float], tol: float = 2e-6) -> None:
    assert sorted(losses) == sorted(reference) and losses
    deltas = {s: abs(losses[s] - reference[s]) for s in reference}
    assert max(deltas.values()) <= tol, deltas


def _device_lines(log: str) -> list[str]:
    return re.findall(
        r"^kunlun \(simulated\): 8 devices; this process on (cpu:\d) .*$", log, flags=re.MULTILINE
    )


@pytest.fixture(scope="module")
def llm(tiny_corpus, tmp_path_factory):
    """``run(name, *args, devices, batch) -> (losses, log)`` and the CPU reference on one process."""
    root = tmp_path_factory.mktemp("kunlun_llm")
    common = [
        "--config", str(TINY_YAML),
        "--data.data_prefix", str(tiny_corpus["prefix"]),
        "--data.tokenizer", str(tiny_corpus["tokenizer"]),
        "--trainer.max_steps", "5",
        "--trainer.enable_checkpointing", "false",
    ]  # fmt: skip

    def run(name: str, *args: str, devices: int = 1, batch: int = 4) -> tuple[dict[int, float], str]:
        log = _forge(
            [*common, "--trainer.devices", str(devices), "--data.batch_size", str(batch),
             "--trainer.logger.init_args.name", name, *args],
            root,
        )  # fmt: skip
        return _losses(root / "runs" / "tests" / name / "version_0" / "metrics.csv"), log

    run.reference, _ = run("cpu")
    assert sorted(run.reference) == STEPS
    return run


def test_one_process_matches_the_cpu_run(llm):
    losses, log = llm("kunlun_one", *KUNLUN)
    _assert_same(losses, llm.reference)
    assert _device_lines(log) == ["cpu:0"], log[-3000:]
    assert "process group backend gloo; platform kunlun" in log


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_match_the_cpu_run(llm, strategy):
    losses, log = llm(f"kunlun_{strategy}", *KUNLUN, "--trainer.strategy", strategy, devices=2, batch=2)
    _assert_same(losses, llm.reference)
    # Both processes set up their own simulated device and chose the runtime's backend.
    assert sorted(_device_lines(log)) == ["cpu:0", "cpu:1"], log[-3000:]
    assert log.count("process group backend gloo; platform kunlun") == 2


def test_kunlun_by_name_is_the_registered_accelerator(tmp_path):
    """``--trainer.accelerator kunlun`` resolves to KunlunAccelerator; without torch_xmlir it says what to install."""
    if importlib.util.find_spec("torch_xmlir") is not None:
        pytest.skip("this machine has the vendor's torch_xmlir: the missing-runtime message cannot show")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "forge_lightning", "fit", "--config", str(TINY_YAML), "--trainer.accelerator", "kunlun",
         "--data.data_prefix", "unused", "--data.tokenizer", "unused"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "install xpytorch (Python module torch_xmlir, with BKCL)" in proc.stdout + proc.stderr


def _vla_config(root: Path, name: str, devices: int) -> Path:
    config = {
        "seed_everything": 3,
        "trainer": {
            "accelerator": "cpu", "devices": devices, "max_steps": 3, "enable_checkpointing": False,
            "enable_progress_bar": False, "enable_model_summary": False, "log_every_n_steps": 1,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(root), "name": name}},
        },
        "model": {
            "class_path": "forge_lightning.modules.embodied.Pi05Policy",
            "init_args": {"config": "debug", "tokenizer": str(FIXTURES / "pi05" / "tokenizer")},
        },
        "data": {
            "class_path": "forge_lightning.datamodules.lerobot.LeRobotDataModule",
            "init_args": {
                "roots": [str(FIXTURES / "lerobot" / "v30")],
                "delta_timestamps": {"action": [0.0, 0.1, 0.2, 0.3, 0.4]},
                "normalization": {"observation.state": "quantiles", "action": "quantiles"},
                "batch_size": 2, "num_workers": 0, "pin_memory": False,
            },
        },
        "optimizer": {"lr": 1e-3},
        "scheduler": {"name": "constant"},
    }  # fmt: skip
    path = root / f"{name}.yaml"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(("devices", "strategy"), [(1, "auto"), (2, "ddp"), (2, "fsdp2")])
def test_tiny_vla_matches_the_cpu_run(tmp_path, devices, strategy):
    """The policy draws its noise from each rank's generator: 2 processes compare with the CPU's 2 processes."""
    pytest.importorskip("pyarrow")
    pytest.importorskip("av")
    runs = {}
    for name, args in (("cpu", []), ("kunlun", KUNLUN)):
        args = [*args, "--trainer.strategy", strategy]
        log = _forge(["--config", str(_vla_config(tmp_path, name, devices)), *args], tmp_path)
        runs[name] = (_losses(tmp_path / name / "version_0" / "metrics.csv"), log)
    _assert_same(runs["kunlun"][0], runs["cpu"][0])
    assert sorted(_device_lines(runs["kunlun"][1])) == [f"cpu:{i}" for i in range(devices)]
    assert not _device_lines(runs["cpu"][1])


def test_the_quick_start_llm_matches_the_cpu_run(tmp_path):
    """The quick-start recipe itself (configs/quickstart/llm.yaml, its callbacks included: throughput, validation
    summary, HF export, text sample), 10 steps on its own data, on the simulated runtime and on the CPU."""
    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, "-m", "forge_lightning.tools.data", "quickstart", "--output", str(data)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    runs = {}
    for name, args in (("cpu", []), ("kunlun", KUNLUN)):
        log = _forge(
            ["--config", str(REPO / "configs" / "quickstart" / "llm.yaml"), *args,
             "--data.data_prefix", str(data / "stdlib_text_document"), "--data.tokenizer", str(data / "tokenizer"),
             "--trainer.max_steps", "10", "--trainer.val_check_interval", "10", "--trainer.limit_val_batches", "2",
             "--trainer.log_every_n_steps", "1", "--trainer.default_root_dir", str(tmp_path / name),
             "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
             "--trainer.logger.save_dir", str(tmp_path), "--trainer.logger.name", name],
            tmp_path,
        )  # fmt: skip
        runs[name] = (_losses(tmp_path / name / "version_0" / "metrics.csv"), log)
    assert sorted(runs["cpu"][0]) == list(range(10))
    _assert_same(runs["kunlun"][0], runs["cpu"][0])
    assert _device_lines(runs["kunlun"][1]) == ["cpu:0"]
