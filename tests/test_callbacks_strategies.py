"""Every shipped LLM callback under every strategy, on 2 CPU processes, against the same run on one process.

One ``forge fit`` per strategy runs them all at once (TextSample, HFExport, GenerationMetric, EMA,
ValidationSummary, ThroughputMonitor: tests/configs/tiny_sft_callbacks.yaml). Losses are equal across layouts
with the same global batch, so every callback's result must equal the one-process reference's::

    reference   1 process, batch 4 ──┬── ddp           2 processes x batch 2
                                     ├── fsdp2         FSDP over 2 ranks, batch 2 each
                                     ├── fsdp2_tp2     TP 2 (one data rank, batch 4); TextSample and GenerationMetric
                                     │                 refuse TP at setup (see the refusal tests)
                                     └── megatron_tp2  MegatronStrategy, TP 2 (one data rank, batch 4), through
                                                       tests/megatron/forge_entry.py (the CPU shim); it
                                                       trains the twin, so the callbacks generate within
                                                       module_weights and EMA averages the twin's TP shards
                                                       (trained_parameters)

A strategy is one entry in STRATEGIES: its command-line overrides and the batch per data-parallel rank that keeps
the global batch at 4. MegatronStrategy's checkpoint holds the EMA average sharded like the twin's parameters, under
the strategy's names: that run also writes the average gathered under the module's names (tests/ema_export.py),
checkpoints at step 2 as well, and a second run resumes from there (EMA, ValidationSummary and the export only).

GenerationMetric's held-out answers are planted so that its count is not a trivial 0: three of the first eight
references are replaced by what the trained model answers (from a first one-process run), two on data rank 0 and
one on rank 1 (rank r takes references r, r + 2, ...), so the check after training reads 3/8 only when both ranks
decoded right and their counts were summed.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from procs import assert_clean_exit

from forge_lightning.callbacks import GenerationMetric, TextSample
from forge_lightning.datamodules.chat import read_conversations
from forge_lightning.tools.data import main as forge_data

TESTS = Path(__file__).resolve().parent
CONFIG = TESTS / "configs" / "tiny_sft_callbacks.yaml"
CLI = ("-m", "forge_lightning")
GLOBAL_BATCH, SEQ, STEPS, NUM_REFERENCES = 4, 64, 4, 8
GENERATING = ("GenerationMetric", "TextSample")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A strategy under test: its ``forge fit`` overrides (2 processes), its batch per data-parallel rank, whether
    TextSample / GenerationMetric run under it (``False``: they refuse it at setup and are left out), the command
    that runs the CLI, and whether its checkpoint keeps the EMA average under the strategy's own parameter names
    (then the run exports it gathered, see tests/ema_export.py, and resumes from its step-2 checkpoint)."""

    args: tuple[str, ...]
    batch_size: int
    generates: bool = True
    entry: tuple[str, ...] = CLI
    strategy_names: bool = False


_FSDP2 = ("--trainer.strategy.class_path", "forge_lightning.strategies.FSDP2Strategy")
STRATEGIES = {
    "ddp": Layout(("--trainer.strategy.class_path", "forge_lightning.strategies.DDPStrategy"), batch_size=2),
    "fsdp2": Layout(_FSDP2, batch_size=2),
    "fsdp2_tp2": Layout(
        (*_FSDP2, "--trainer.strategy.init_args.tensor_parallel_size", "2"), batch_size=4, generates=False
    ),
}
if importlib.util.find_spec("megatron") and importlib.util.find_spec("megatron.core"):
    STRATEGIES["megatron_tp2"] = Layout(
        (
            *("--trainer.strategy.class_path", "forge_lightning.strategies.megatron.MegatronStrategy"),
            *("--trainer.strategy.init_args.tensor_model_parallel_size", "2"),
        ),
        batch_size=4,
        entry=(str(TESTS / "megatron" / "forge_entry.py"),),  # megatron-core needs the CPU shim
        strategy_names=True,
    )
WITH_GENERATION = [name for name, layout in STRATEGIES.items() if layout.generates]
SHARDED_EMA = [name for name, layout in STRATEGIES.items() if layout.strategy_names]


@dataclasses.dataclass(frozen=True)
class Run:
    log_dir: Path
    output: str  # stdout (the printed sample) + stderr (rank_zero_info lines)


def _forge(args: list[str], cwd: Path, entry: tuple[str, ...] = CLI) -> Run:
    # Own session: on a timeout (a collective that never pairs up hangs both ranks) the whole group is killed.
    # tests/ on the path: the ema_export callback.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("WANDB_") and k not in ("MASTER_ADDR", "MASTER_PORT")
    }
    env = {
        **env,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(
        [sys.executable, *entry, *args], cwd=cwd, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"forge {' '.join(args)} timed out\n{(stdout + stderr)[-6000:]}")
    assert_clean_exit(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    save_dir = Path(args[args.index("--trainer.logger.init_args.save_dir") + 1])
    return Run(save_dir / "version_0", stdout + stderr)


def _until_stop(ids: list[int], stop: list[int]) -> list[int]:
    return next((ids[:k] for k, token in enumerate(ids) if token in stop), ids)


def _answers(export: Path, data: dict, indices: list[int]) -> list[str]:
    """Greedy answers of the exported model to the held-out prompts ``indices``, decoded as GenerationMetric does."""
    from forge_lightning.datamodules import SFTDataModule
    from forge_lightning.modules.llm import CausalLM

    datamodule = SFTDataModule(
        str(data["train"]), str(data["tokenizer"]), val_files=str(data["val"]), seq_length=SEQ
    )
    references, stop = datamodule.generation_references("val"), datamodule.stop_token_ids
    lengths = [len(r.prompt_ids) for r in references[:NUM_REFERENCES]]
    # Each prompt length occurs once, so every run decodes these prompts alone, as here.
    assert all(lengths.count(lengths[i]) == 1 for i in indices), lengths
    model = CausalLM.from_pretrained(export)
    answers = []
    for i in indices:
        prompt = torch.tensor([references[i].prompt_ids])
        out = model.generate(prompt, max_new_tokens=8, eos_token_id=stop)
        answers.append(datamodule.decode(_until_stop(out[0, prompt.shape[1] :].tolist(), stop)))
    return answers


def _write_conversations(path: Path, conversations: list[list[dict]]) -> None:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> dict:
    """The SFT quick-start data, its held-out file with three answers replaced by what the trained model answers
    (those of a first one-process run of the same config on the original file: validation data do not change
    the training)."""
    root = tmp_path_factory.mktemp("callbacks_sft")
    forge_data(["sft-quickstart", "--output", str(root), "--num-train", "200", "--num-val", "16"])
    conversations = [c.messages for c in read_conversations(root / "val.jsonl")]
    data = {"train": root / "train.jsonl", "val": root / "val_plain.jsonl", "tokenizer": root / "tokenizer"}
    _write_conversations(data["val"], conversations)
    first = _fit(root, "first", CONFIG, data, "--data.batch_size", str(GLOBAL_BATCH))
    planted = [0, 1, 2]  # references of data ranks 0, 1, 0
    answers = _answers(first.log_dir / "hf", data, planted)
    assert all(a.strip() for a in answers), answers
    for i, answer in zip(planted, answers, strict=True):
        last = max(k for k, m in enumerate(conversations[i]) if m["role"] == "assistant")
        conversations[i][last]["content"] = answer
    data["val"] = root / "val_planted.jsonl"
    _write_conversations(data["val"], conversations)
    return {**data, "planted": len(planted), "root": root}


def _data_args(data: dict) -> list[str]:
    return [
        *("--data.train_files", str(data["train"]), "--data.val_files", str(data["val"])),
        *("--data.tokenizer", str(data["tokenizer"])),
    ]


def _config(root: Path, name: str, *, keep: tuple[str, ...] | None = None, ema_export: bool = False) -> Path:
    """CONFIG for run ``name``: only the callbacks named in ``keep`` (``None``: all; no ModelCheckpoint means
    checkpointing off); with ``ema_export``, also a checkpoint at step 2 and the gathered EMA average written to
    ``<root>/<name>/ema.pt``."""
    config = yaml.safe_load(CONFIG.read_text())
    callbacks = config["trainer"]["callbacks"]
    if keep is not None:
        callbacks = [c for c in callbacks if c["class_path"].rsplit(".", 1)[-1] in keep]
        config["trainer"]["enable_checkpointing"] = any(
            "ModelCheckpoint" in c["class_path"] for c in callbacks
        )
    if ema_export:
        for c in callbacks:
            if c["class_path"].endswith("ModelCheckpoint"):
                c["init_args"] = {"every_n_train_steps": 2, "save_top_k": -1}
        callbacks.append(
            {"class_path": "ema_export.ExportEMA", "init_args": {"path": str(root / name / "ema.pt")}}
        )
    config["trainer"]["callbacks"] = callbacks
    path = root / f"tiny_sft_callbacks_{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _fit(
    root: Path, name: str, config: Path, data: dict, *overrides: str, entry: tuple[str, ...] = CLI
) -> Run:
    args = ["fit", "--config", str(config), *_data_args(data)]
    return _forge([*args, "--trainer.logger.init_args.save_dir", str(root / name), *overrides], root, entry)


def _two_processes(layout: Layout) -> tuple[str, ...]:
    return (*layout.args, "--trainer.devices", "2", "--data.batch_size", str(layout.batch_size))


@pytest.fixture(scope="module")
def runs(sft_data) -> dict[str, Run]:
    """The one-process reference and one 2-process run per strategy."""
    root = sft_data["root"]
    done = {"reference": _fit(root, "reference", CONFIG, sft_data, "--data.batch_size", str(GLOBAL_BATCH))}
    without_generation = tuple(
        c["class_path"].rsplit(".", 1)[-1]
        for c in yaml.safe_load(CONFIG.read_text())["trainer"]["callbacks"]
        if c["class_path"].rsplit(".", 1)[-1] not in GENERATING
    )
    for name, layout in STRATEGIES.items():
        keep = None if layout.generates else without_generation
        config = _config(root, name, keep=keep, ema_export=layout.strategy_names)
        done[name] = _fit(root, name, config, sft_data, *_two_processes(layout), entry=layout.entry)
    return done


@pytest.fixture(scope="module")
def resumed(runs, sft_data) -> dict[str, Run]:
    """Per strategy whose checkpoint keeps the EMA under its own names: its run again from its step-2 checkpoint to
    step 4 (EMA, ValidationSummary and the gathered export only; no checkpoints)."""
    root, done = sft_data["root"], {}
    for name in SHARDED_EMA:
        layout, run = STRATEGIES[name], f"{name}_resumed"
        config = _config(root, run, keep=("EMA", "ValidationSummary"), ema_export=True)
        ckpt = ("--ckpt_path", str(_checkpoint(runs[name], step=2)))
        done[name] = _fit(root, run, config, sft_data, *_two_processes(layout), *ckpt, entry=layout.entry)
    return done


def _rows(run: Run) -> list[dict[str, str]]:
    return list(csv.DictReader((run.log_dir / "metrics.csv").read_text().splitlines()))


def _logged(run: Run, key: str) -> list[float]:
    return [float(r[key]) for r in _rows(run) if r.get(key)]


# ----- TextSample ----------------------------------------------------------------------------------------------
def _sample(run: Run) -> str:
    samples = re.findall(r"--- sample after (\d+) steps ---\n(.*?)\n---", run.output, flags=re.DOTALL)
    assert [int(step) for step, _ in samples] == [STEPS], run.output[-3000:]  # printed once, by rank 0
    return samples[0][1]


@pytest.mark.parametrize("strategy", WITH_GENERATION)
def test_text_sample_equals_one_process(runs, strategy):
    sample = _sample(runs[strategy])
    assert sample == _sample(runs["reference"])
    assert sample.startswith("How many") and len(sample) > len("How many")


def test_reference_sample_is_the_trained_models_generation(runs):
    from forge_lightning.datamodules.tokenizer import load_tokenizer
    from forge_lightning.modules.llm import CausalLM

    export = runs["reference"].log_dir / "hf"
    tokenizer, model = load_tokenizer(export), CausalLM.from_pretrained(export)
    ids = torch.tensor([tokenizer.encode("How many")])
    out = model.generate(ids, max_new_tokens=8, eos_token_id=tokenizer.eos_token_id)
    assert _sample(runs["reference"]) == "How many" + tokenizer.decode(out[0, ids.shape[1] :].tolist())


# ----- HFExport ------------------------------------------------------------------------------------------------
def _export_logits(run: Run) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run.log_dir / "hf")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hf_export_loads_and_equals_one_process(runs, strategy):
    assert (runs[strategy].log_dir / "hf" / "tokenizer.json").is_file()
    got, expected = _export_logits(runs[strategy]), _export_logits(runs["reference"])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


# ----- GenerationMetric ----------------------------------------------------------------------------------------
def _exact_match_lines(run: Run) -> list[tuple[str, int, int, int]]:
    """(value, correct, total, step) of each printed ``val/exact_match`` evaluation."""
    found = re.findall(r"val/exact_match: ([\d.]+) \((\d+)/(\d+)\) at step (\d+)", run.output)
    return [(value, int(c), int(t), int(s)) for value, c, t, s in found]


@pytest.mark.parametrize("strategy", WITH_GENERATION)
def test_generation_metric_sums_counts_over_ranks(runs, sft_data, strategy):
    lines = _exact_match_lines(runs[strategy])
    assert lines == _exact_match_lines(runs["reference"])
    assert [step for *_, step in lines] == [0, STEPS]
    # After training: the planted answers, two found on data rank 0 and one on rank 1, summed.
    planted = sft_data["planted"]
    assert lines[-1] == (f"{planted / NUM_REFERENCES:.3f}", planted, NUM_REFERENCES, STEPS)
    assert _logged(runs[strategy], "val/exact_match") == _logged(runs["reference"], "val/exact_match")


# ----- EMA -----------------------------------------------------------------------------------------------------
def _checkpoint(run: Run, step: int = STEPS) -> Path:
    return run.log_dir / "checkpoints" / f"epoch=0-step={step}.ckpt"


def _exported_ema(run: Run) -> dict[str, torch.Tensor]:
    return torch.load(run.log_dir.parent / "ema.pt", weights_only=True)


def _ema_average(run: Run, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if (run.log_dir.parent / "ema.pt").is_file():  # gathered under the module's names (MegatronStrategy)
        exported = _exported_ema(run)
        return {n: exported[n] for n in like if n in exported}
    path = _checkpoint(run)
    if path.is_file():
        return torch.load(path, weights_only=True)["callbacks"]["EMA"]["average"]
    # A sharded (DCP) checkpoint: the average's entries are "callbacks/EMA/average/<name>", read whole here.
    from torch.distributed.checkpoint import load

    entries = {f"callbacks/EMA/average/{n}": torch.empty_like(t) for n, t in like.items()}
    load(entries, checkpoint_id=path)
    return {n: entries[f"callbacks/EMA/average/{n}"] for n in like}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ema_average_and_evaluation_equal_one_process(runs, strategy):
    reference = torch.load(_checkpoint(runs["reference"]), weights_only=True)
    expected = reference["callbacks"]["EMA"]["average"]
    got = _ema_average(runs[strategy], like=expected)
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    # The average is far from the trained weights (decay 0.5 over 4 steps), so a validation on the wrong weights
    # would show in the loss; the one after step 4 is on the average, as in the reference.
    weights = reference["state_dict"]
    assert max((expected[n] - weights[n]).abs().max().item() for n in expected) > 1e-3
    val_loss = _logged(runs[strategy], "val/loss")
    assert len(val_loss) == 1  # the sanity check logs nothing
    assert val_loss[0] == pytest.approx(_logged(runs["reference"], "val/loss")[0], abs=1e-5)


@pytest.mark.parametrize("strategy", SHARDED_EMA)
def test_ema_is_checkpointed_sharded_and_resumes_exactly(runs, resumed, strategy):
    from torch.distributed.checkpoint import FileSystemReader

    # The step-2 checkpoint: meta.pt holds a stand-in; the dist-checkpoint holds the average beside each of the
    # model's tensors, under the same global key (layers stacked, each TP rank's slice) with the EMA's prefix.
    ckpt = _checkpoint(runs[strategy], step=2)
    meta = torch.load(ckpt / "meta.pt", weights_only=True)["callbacks"]["EMA"]
    assert meta == {"average": "megatron-sharded:callbacks.EMA.average", "last_step": 2}
    keys = set(FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    prefix = "callbacks.EMA.average."
    model_keys = {
        k for k in keys if not k.startswith(("callbacks.", "optimizer.")) and "_extra_state" not in k
    }
    assert model_keys and {k.removeprefix(prefix) for k in keys if k.startswith(prefix)} == model_keys
    # Resumed from it, the run ends with the same average (an average restarted from the step-2 weights would
    # differ: see the weights' distance from the average in the test above) and validates on it.
    got, expected = _exported_ema(resumed[strategy]), _exported_ema(runs[strategy])
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    assert _logged(resumed[strategy], "val/loss") == _logged(runs[strategy], "val/loss")
    steps = {int(r["step"]): float(r["train/loss"]) for r in _rows(resumed[strategy]) if r.get("train/loss")}
    straight = {int(r["step"]): float(r["train/loss"]) for r in _rows(runs[strategy]) if r.get("train/loss")}
    assert sorted(steps) == [2, 3] and all(steps[s] == straight[s] for s in steps)


# ----- ValidationSummary ---------------------------------------------------------------------------------------
def _summary(run: Run) -> list[tuple[float, float]]:
    found = re.findall(
        rf"val/loss: ([\d.]+) at step 0 -> ([\d.]+) at step {STEPS} \([+-][\d.]+%\)", run.output
    )
    return [(float(first), float(last)) for first, last in found]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_validation_summary_prints_first_to_last(runs, strategy):
    (got,) = _summary(runs[strategy])  # once, by rank 0
    (expected,) = _summary(runs["reference"])
    assert got == pytest.approx(expected, abs=2e-4)  # printed to 4 decimals
    assert got[1] < got[0]


# ----- ThroughputMonitor ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", [*STRATEGIES, "reference"])
def test_throughput_counts_every_data_rank_once(runs, strategy):
    rows = [r for r in _rows(runs[strategy]) if r.get("throughput/tokens_per_sec")]
    assert len(rows) == STEPS - 1  # windows of one step, the first skipped as warm-up
    devices = 1 if strategy == "reference" else 2
    for row in rows:
        step_time = float(row["throughput/step_time_s"])
        tokens_per_s = float(row["throughput/tokens_per_sec"])
        # The global batch, summed over the data-parallel ranks (under TP both ranks hold the same one).
        assert tokens_per_s * step_time == pytest.approx(GLOBAL_BATCH * SEQ, rel=1e-6)
        assert float(row["throughput/samples_per_sec"]) * step_time == pytest.approx(GLOBAL_BATCH, rel=1e-6)
        per_device = float(row["throughput/tokens_per_sec_per_device"])
        assert per_device == pytest.approx(tokens_per_s / devices, rel=1e-6)


# ----- refusals ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "callback", [TextSample(), GenerationMetric()], ids=["TextSample", "GenerationMetric"]
)
def test_generation_refuses_tensor_parallel_at_setup(callback):
    class FSDP2Strategy:  # stands for the strategy after setup_environment, its mesh built
        tensor_parallel_size = 2

    trainer = SimpleNamespace(strategy=FSDP2Strategy(), world_size=2)
    name = type(callback).__name__
    message = (
        rf"{name} cannot generate under FSDP2Strategy with tensor_parallel_size=2: .* Use tensor_parallel_size: 1 "
        rf".* or leave {name} out and generate from the HFExport directory"
    )
    with pytest.raises(ValueError, match=message):
        callback.setup(trainer, None, "fit")


@pytest.mark.parametrize(
    "callback", [TextSample(), GenerationMetric()], ids=["TextSample", "GenerationMetric"]
)
def test_generation_is_not_refused_with_separate_weights(callback):
    class MegatronLike:  # trains another model and copies whole weights into the module (SeparateWeights)
        tensor_parallel_size = 2

        def module_weights(self):
            return contextlib.nullcontext()

    callback.setup(SimpleNamespace(strategy=MegatronLike(), world_size=2), None, "fit")  # no error
