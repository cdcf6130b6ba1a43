"""Per-component parallelism under MegatronStrategy: a composed model (encoder -> projector -> LLM,
encoder_decoder.py) with the encoder side at TP = 1 and the decoder at TP = 2 trains to the one-process losses.

One 2-process launch (components_worker.py, ~45 s) runs every case; the references are the same module under
Lightning's default strategy on this process, with the same global batch (fp32, AdamW lr 1e-3; 3 steps with
validation on 2 batches after every step, or for the checkpoint cases 5 steps from forge's resumable loader):

    tp2         TP 2 (DP 1), batch 3 (the second TP rank pads its share), 2 micro-batches, full recompute of the
                encoder's blocks and of the decoder's layers
    tp2_sp      TP 2 + sequence parallel (the merged inputs scattered over the sequence after the hand-over)
    tp2_frozen  TP 2, encoder and LLM frozen by the strategy's option: only the projector trains
    dp2         TP 1 x DP 2: the encoder side's gradients all-reduced over the data-parallel ranks
    bad_name    an unknown component: a clear error through Trainer.fit on both ranks
    ckpt_tp2    TP 2, batch 4 x 2 micro-batches, 5 steps: a checkpoint after step 3 (the encoder side and its
                optimizer state in megatron's dist-checkpoint), full_model_state_dict() before and after
    ckpt_tp2_resume   resumes ckpt_tp2's checkpoint at TP 2 for steps 3-4
    ckpt_tp2_to_dp2   resumes it at TP 1 x DP 2 (batch 2 per rank: the same global micro-batches)
    bad_resume_frozen resumes it with the encoder frozen: refused before loading
"""

import csv
import dataclasses
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from components_worker import CASES, CKPT, build_module, encoder_side, fit_data, trainer_kwargs
from conftest import torchrun
from encoder_decoder import EncoderDecoderLM
from torch.distributed.checkpoint import FileSystemReader

from forge_lightning.contracts import Component, Composition, MegatronDims, ParallelPlan
from forge_lightning.strategies.megatron.components import (
    ComponentOptions,
    parse_components,
    resolve_components,
    sample_rows,
)

HERE = Path(__file__).resolve().parent
LOSS_TOL = 1e-5  # |train/loss or val/loss - one process| per step (measured <= 9.5e-7)
# |encoder side after 3 steps - one process|: Adam amplifies fp32 rounding (measured <= 1.1e-5)
PARAM_TOL = 1e-4
EXPORT_TOL = 2e-4  # the same after 5 steps, decoder included (measured <= 4.8e-5; 0 before the first step)


def _losses(root: Path, name: str, key: str = "train/loss") -> dict[int, float]:
    rows = csv.DictReader((root / name / "version_0" / "metrics.csv").open())
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


_REFERENCES: dict[tuple, tuple] = {}


def _reference(root: Path, name: str) -> tuple[dict, dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The case's reference run (cached: cases with the same global batch share one): train/loss, val/loss, the
    encoder side's parameters and the module's state dict after the steps."""
    ref = CASES[name]["reference"]
    resumable = "checkpoint" in CASES[name]
    key = (root, ref["batch"], ref["accumulate"], tuple(ref.get("freeze", ())), resumable)
    if key not in _REFERENCES:
        module = build_module(ref.get("freeze"))
        logged = f"{name}_reference"
        kwargs = trainer_kwargs(root, logged, ref["accumulate"], resumable=resumable)
        pl.Trainer(devices=1, **kwargs).fit(module, **fit_data(ref["batch"], resumable=resumable))
        val = {} if resumable else _losses(root, logged, "val/loss")
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        _REFERENCES[key] = _losses(root, logged), val, encoder_side(module), state
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("components")
    torchrun(HERE / "components_worker.py", root, *CASES)
    return root


@pytest.mark.parametrize("name", ["tp2", "tp2_sp", "dp2", "dp2_distopt"])
def test_composed_model_matches_one_process(runs, name):
    losses, val = _losses(runs, name), _losses(runs, name, "val/loss")
    expected, expected_val, reference_params, _ = _reference(runs, name)
    assert sorted(losses) == sorted(expected) == sorted(val) == sorted(expected_val) == [0, 1, 2]
    deltas = {s: abs(losses[s] - expected[s]) for s in losses}
    assert max(deltas.values()) <= LOSS_TOL, deltas
    val_deltas = {s: abs(val[s] - expected_val[s]) for s in val}
    assert max(val_deltas.values()) <= LOSS_TOL, val_deltas
    ranks = [torch.load(runs / f"{name}_rank{r}.pt") for r in (0, 1)]
    # components.encoder / components.llm recompute: full in the tp2 case only
    recompute = (ranks[0]["recompute"], ranks[0]["encoder_recompute"])
    assert recompute == (("full", True) if name == "tp2" else (None, False))
    assert ranks[0]["recompute"] == ("full" if name == "tp2" else None)  # the decoder's, from components.llm
    for key, value in ranks[0]["after"].items():
        assert torch.equal(value, ranks[1]["after"][key]), key  # the replicas stay identical
        assert (value - ranks[0]["before"][key]).abs().max() > 0, key  # and trained
        assert (value - reference_params[key]).abs().max() <= PARAM_TOL, key


def test_distributed_optimizer_shards_the_decoder_and_keeps_the_encoder_side_whole(runs):
    """With ``use_distributed_optimizer`` each DP rank's optimizer holds half of the twin's main weights plus the
    whole encoder side (its own optimizer, chained), against the plain optimizer's full copy."""
    for rank in (0, 1):
        plain = torch.load(runs / f"dp2_rank{rank}.pt")["optimizer_numel"]
        sharded = torch.load(runs / f"dp2_distopt_rank{rank}.pt")["optimizer_numel"]
        assert sharded < 0.75 * plain, (rank, sharded, plain)


def test_gradient_norm_is_the_same_at_every_layout(runs):
    """Same global batch (6 samples a step) and weights: the gradient norm counts the replicated encoder side once."""
    norms = {name: _losses(runs, name, "train/grad_norm") for name in ("tp2", "tp2_sp", "dp2")}
    for step in range(3):
        values = [n[step] for n in norms.values()]
        assert max(values) - min(values) <= 1e-5 * max(values), (step, norms)


def test_frozen_components_stay_unchanged(runs):
    losses = _losses(runs, "tp2_frozen")
    expected, _, reference_params, _ = _reference(runs, "tp2_frozen")
    assert max(abs(losses[s] - expected[s]) for s in expected) <= LOSS_TOL, (losses, expected)
    for rank in (0, 1):
        run = torch.load(runs / f"tp2_frozen_rank{rank}.pt")
        assert (
            run["optimizer_params"] == 4
        )  # the projector's two weights and biases: no state for frozen ones
        for key, value in run["after"].items():
            if key.startswith("encoder."):
                assert torch.equal(value, run["before"][key]), key
            else:
                assert (value - run["before"][key]).abs().max() > 0, key
                assert (value - reference_params[key]).abs().max() <= PARAM_TOL, key


def test_unknown_component_and_a_change_of_freezing_fail_clearly_through_fit(runs):
    message = (runs / "bad_name_error.txt").read_text()
    assert message == (
        "ValueError: components names ['vision'], but the module's plan has the components "
        "['encoder', 'projector', 'llm']"
    )
    message = (runs / "bad_resume_frozen_error.txt").read_text()
    assert message.startswith("ValueError: ") and (
        "was written with the components [] frozen, this run freezes ['encoder']" in message
    ), message


# ----------------------------------------------------------------------------------------------- checkpoints


def test_checkpoint_resumes_exactly_at_the_same_layout(runs):
    full, resumed = _losses(runs, "ckpt_tp2"), _losses(runs, "ckpt_tp2_resume")
    assert sorted(full) == [0, 1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert all(resumed[s] == full[s] for s in (3, 4)), (resumed, full)
    expected = _reference(runs, "ckpt_tp2")[0]
    assert max(abs(full[s] - expected[s]) for s in expected) <= LOSS_TOL, (full, expected)
    for rank in (0, 1):  # the encoder side after steps 3-4: as without the interruption
        after = torch.load(runs / f"ckpt_tp2_rank{rank}.pt")["after"]
        resumed_after = torch.load(runs / f"ckpt_tp2_resume_rank{rank}.pt")["after"]
        assert all(torch.equal(resumed_after[k], v) for k, v in after.items())
    # The encoder side and its Adam moments are in megatron's dist-checkpoint beside the twin's.
    stored = FileSystemReader(str(runs / "ckpt_ckpt_tp2" / CKPT)).read_metadata().state_dict_metadata
    for key in ("encoder.patch_embed.weight", "projector.fc2.bias"):
        assert f"components.{key}" in stored and f"optimizer.state.exp_avg_sq.components.{key}" in stored
    config = json.loads((runs / "ckpt_ckpt_tp2" / CKPT / "config.json").read_text())
    assert config["num_hidden_layers"] == EncoderDecoderLM().model.llm.config.num_layers  # the decoder's


def test_distributed_optimizer_checkpoint_resumes_exactly(runs):
    """DP = 2 with the distributed optimizer (and the encoder side's own optimizer chained to it): the resumed steps
    3-4 give the uninterrupted run's losses and encoder weights, and both match one process."""
    full, resumed = _losses(runs, "ckpt_distopt"), _losses(runs, "ckpt_distopt_resume")
    assert sorted(full) == [0, 1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert all(resumed[s] == full[s] for s in (3, 4)), (resumed, full)
    expected = _reference(runs, "ckpt_distopt")[0]
    assert max(abs(full[s] - expected[s]) for s in expected) <= LOSS_TOL, (full, expected)
    for rank in (0, 1):
        after = torch.load(runs / f"ckpt_distopt_rank{rank}.pt")["after"]
        resumed_after = torch.load(runs / f"ckpt_distopt_resume_rank{rank}.pt")["after"]
        assert all(torch.equal(resumed_after[k], v) for k, v in after.items())


def test_checkpoint_loads_at_another_decoder_layout(runs):
    """TP 2 -> TP 1 x DP 2: the next steps' losses within fp32 rounding of another reduction order."""
    full, moved = _losses(runs, "ckpt_tp2"), _losses(runs, "ckpt_tp2_to_dp2")
    assert sorted(moved) == [3, 4]
    deltas = {s: abs(moved[s] - full[s]) for s in (3, 4)}
    assert max(deltas.values()) <= LOSS_TOL, deltas
    ranks = [torch.load(runs / f"ckpt_tp2_to_dp2_rank{r}.pt")["after"] for r in (0, 1)]
    uninterrupted = torch.load(runs / "ckpt_tp2_rank0.pt")["after"]
    for key, value in ranks[0].items():
        assert torch.equal(value, ranks[1][key]), key
        assert (value - uninterrupted[key]).abs().max() <= PARAM_TOL, key


def test_full_model_state_dict_gives_the_native_state_dict(runs):
    """Before training: the native module's state dict exactly (names, order, values); after 5 steps: the live
    encoder side exactly and the one-process run's weights within fp32 rounding amplified by Adam."""
    exported = torch.load(runs / "ckpt_tp2_export.pt")
    initial = build_module().state_dict()
    assert list(exported["start"]) == list(initial)  # the LightningModule's names, in its order
    assert all(torch.equal(exported["start"][k], v) for k, v in initial.items())
    live = torch.load(runs / "ckpt_tp2_rank0.pt")["after"]  # the encoder side after the last step
    assert all(torch.equal(exported["end"][f"model.{k}"], v) for k, v in live.items())
    reference = _reference(runs, "ckpt_tp2")[3]  # the same 5 steps on one process
    deltas = {k: float((exported["end"][k] - v).abs().max()) for k, v in reference.items()}
    assert list(exported["end"]) == list(reference) and max(deltas.values()) <= EXPORT_TOL, deltas
    # A submodule's keys are relative to it (the decoder's: its Hugging Face names).
    decoder = {
        k.removeprefix("model.llm."): v for k, v in exported["end"].items() if k.startswith("model.llm.")
    }
    assert list(exported["llm_end"]) == list(decoder)
    assert all(torch.equal(exported["llm_end"][k], v) for k, v in decoder.items())
    build_module().load_state_dict(exported["end"], strict=True)


# ----------------------------------------------------------------------------------------------- option checks

DEGREES = dict(
    tensor_model_parallel_size=2,
    pipeline_model_parallel_size=1,
    context_parallel_size=1,
    use_distributed_optimizer=False,
)


@pytest.mark.parametrize(
    ("raw", "error", "match"),
    [
        ({"encoder": {"tp": 1}}, ValueError, r"components.encoder: unknown option\(s\) \['tp'\]"),
        ({"encoder": {"tensor_model_parallel_size": 3}}, ValueError, r"\(3\) must divide .* \(2\)"),
        ({"encoder": {"tensor_model_parallel_size": 0}}, ValueError, "must be a positive integer"),
        ({"encoder": {"recompute": "selective"}}, ValueError, r"recompute must be one of \['none', 'full'\]"),
        ({"encoder": {"freeze": "yes"}}, ValueError, "freeze must be true, false or null"),
        ({"encoder": 1}, TypeError, "components.encoder must be a mapping"),
        ([1], TypeError, "components must map component names"),
    ],
)
def test_component_options_are_checked(raw, error, match):
    with pytest.raises(error, match=match):
        parse_components(raw, tensor_model_parallel_size=2)


def _plan() -> ParallelPlan:
    torch.manual_seed(0)
    return EncoderDecoderLM().parallel_plan()


def _resolve(raw, **degrees):
    return resolve_components(_plan(), parse_components(raw, 2), MegatronDims(**{**DEGREES, **degrees}))


def test_components_resolve_against_the_plan():
    resolved = {
        r.component.name: r for r in _resolve({"llm": {"recompute": "full"}, "projector": {"freeze": True}})
    }
    assert {
        n: (r.decoder, r.tensor_model_parallel_size, r.recompute, r.frozen) for n, r in resolved.items()
    } == {
        "encoder": (False, 1, "none", False),
        "projector": (False, 1, "none", True),
        "llm": (True, 2, "full", False),
    }


@pytest.mark.parametrize(
    ("raw", "degrees", "error", "match"),
    [
        (
            {"vision": {}},
            {},
            ValueError,
            r"components names \['vision'\], but .* \['encoder', 'projector', 'llm'\]",
        ),
        (
            {"llm": {"tensor_model_parallel_size": 1}},
            {},
            ValueError,
            "'llm' is the decoder, which runs at the",
        ),
        (
            {"encoder": {"tensor_model_parallel_size": 2}},
            {},
            NotImplementedError,
            "TP size > 1 needs a tensor-para",
        ),
        (
            {"encoder": {"recompute": "full", "freeze": True}},
            {},
            ValueError,
            "on a frozen component does nothing",
        ),
        ({"projector": {"recompute": "full"}}, {}, ValueError, "declares no blocks for 'projector'"),
        (
            {c: {"freeze": True} for c in ("encoder", "projector", "llm")},
            {},
            ValueError,
            "every component is frozen",
        ),
        (
            {},
            {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
            NotImplementedError,
            "virtual_pipeline_model_parallel_size=2 is not yet supported with a composed model",
        ),
        (
            {},
            {"pipeline_model_parallel_size": 2, "use_distributed_optimizer": True},
            NotImplementedError,
            "use_distributed_optimizer with pipeline_model_parallel_size=2 is not yet supported",
        ),
        ({}, {"context_parallel_size": 2}, NotImplementedError, "context_parallel_size=2 is not yet"),
    ],
)
def test_bad_component_settings_are_refused(raw, degrees, error, match):
    with pytest.raises(error, match=match):
        _resolve(raw, **degrees)


def test_plans_without_composition():
    plan = _plan()
    single = ParallelPlan(components=[plan.component("llm")])
    (llm,) = resolve_components(single, {"llm": ComponentOptions(recompute="full")}, MegatronDims(**DEGREES))
    assert llm.decoder and llm.recompute == "full"  # a CausalLM: its one component is the decoder
    with pytest.raises(ValueError, match="every component is frozen"):
        resolve_components(single, {"llm": ComponentOptions(freeze=True)}, MegatronDims(**DEGREES))
    several = dataclasses.replace(plan, composition=None)
    with pytest.raises(
        ValueError,
        match="no composition: MegatronStrategy needs to know which one its megatron-core model stands for",
    ):
        resolve_components(several, {}, MegatronDims(**DEGREES))
    with pytest.raises(ValueError, match=r"composition.decoder \('vision'\) must be one of the components"):
        ParallelPlan(
            components=[Component(name="llm", module=torch.nn.Linear(1, 1))],
            composition=Composition(decoder="vision", encode=lambda b: b, merge=lambda *a: a),
        )


def test_sample_rows_pad_the_last_rank():
    assert [sample_rows(3, r, 2).tolist() for r in range(2)] == [[0, 1], [2, 2]]
    assert [sample_rows(4, r, 2).tolist() for r in range(2)] == [[0, 1], [2, 3]]
    assert [sample_rows(1, r, 4).tolist() for r in range(4)] == [[0], [0], [0], [0]]


def test_megatron_strategy_refuses_the_fp8_performance_section():
    # performance.fp8 (torchao linears, FP8 attention, the FP8 output head) is applied by the torch-native
    # strategies only; under MegatronStrategy it would be silently ignored, so setup stops with the reason.
    from unittest import mock

    from lightning.pytorch.accelerators import CPUAccelerator
    from tiny import TINY_LLM

    from forge_lightning.modules.llm import CausalLM
    from forge_lightning.strategies.megatron import MegatronStrategy

    strategy = MegatronStrategy()
    strategy.accelerator = CPUAccelerator()
    strategy._lightning_module = CausalLM(config=TINY_LLM, performance={"fp8": {"lm_head": True}})
    with pytest.raises(ValueError, match="performance.fp8 is not applied under MegatronStrategy"):
        strategy.setup(mock.MagicMock())
