"""A LLaVA-type vision-language model (SigLIP tower + MLP projector + Llama) under MegatronStrategy trains to the
one-process losses and weights.

One 2-process launch (vlm_worker.py, ~20 s) runs every case; the reference is the same ``VisionLanguageModule`` under
Lightning's default strategy on this process, with the same batches (fp32, AdamW lr 1e-3, 3 steps of 3 micro-batches
of 3 samples holding 0, 1 and 2 images, validation on 2 batches after every step):

    tp2              the LLM at TP 2, the encoder side at TP 1 data-parallel over the TP group (rank 0 encodes
                     samples 0-1, rank 1 sample 2 and a padding copy of it; the features all-gathered), the vision
                     blocks recomputed
    pp2              the LLM at PP 2 (1F1B), the encoder side decoupled from the pipeline and spread over both stages
                     (the default): each stage encodes its run of the step's 9 samples (4 and 5) before the schedule,
                     the features gathered on the first stage, their gradients sent back after it and each stage
                     back-propagating its own; a checkpoint after the last step, which ``validate_pp2_at_tp2`` loads
                     at TP 2
    pp2_first_stage  PP 2 with ``encoder_placement: first_stage``: the first stage encodes the 3 micro-batches before
                     the schedule and back-propagates them after it, the last holds no encoder side
"""

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import torchrun
from vlm_worker import CASES, IMAGE_TOKEN, build_module, collate, data, fit_kwargs, samples

from forge_lightning.contracts import MegatronBuild, MegatronDims
from forge_lightning.modules.vlm import VisionLanguageModule
from forge_lightning.modules.vlm.megatron import encode, merge, select
from forge_lightning.strategies.megatron.components import parse_placement
from forge_lightning.strategies.megatron.spread import step_shares

HERE = Path(__file__).resolve().parent
LOSS_TOL = 1e-5  # |train/loss or val/loss - one process| per step, as test_components.py (measured <= 1e-6)
PARAM_TOL = (
    1e-4  # |weights after 3 steps - one process|: Adam amplifies fp32 rounding (as test_components.py)
)


def _losses(root: Path, name: str, key: str = "train/loss") -> dict[int, float]:
    rows = csv.DictReader((root / name / "version_0" / "metrics.csv").open())
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    torchrun(HERE / "vlm_worker.py", root, *CASES)
    return root


@pytest.fixture(scope="module")
def reference(runs):
    """train/loss, val/loss and the state dict of the one-process run."""
    module = build_module()
    pl.Trainer(devices=1, **fit_kwargs(runs, "reference")).fit(
        module, train_dataloaders=data(), val_dataloaders=data()
    )
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return _losses(runs, "reference"), _losses(runs, "reference", "val/loss"), state


@pytest.mark.parametrize("name", ["tp2", "pp2", "pp2_first_stage"])
def test_vlm_matches_one_process(runs, reference, name):
    expected, expected_val, expected_state = reference
    losses, val = _losses(runs, name), _losses(runs, name, "val/loss")
    assert sorted(losses) == sorted(val) == sorted(expected) == sorted(expected_val) == [0, 1, 2]
    deltas = {s: abs(losses[s] - expected[s]) for s in losses}
    assert max(deltas.values()) <= LOSS_TOL, deltas
    val_deltas = {s: abs(val[s] - expected_val[s]) for s in val}
    assert max(val_deltas.values()) <= LOSS_TOL, val_deltas
    initial = build_module().state_dict()
    for rank in (0, 1):
        state = torch.load(runs / f"{name}_rank{rank}.pt")["state"]
        assert list(state) == list(expected_state)
        for key, value in state.items():  # the encoder side (vision, projector) and the LLM
            # trained as on one process (not the SigLIP layers after the feature layer, which get no gradient)
            assert torch.equal(value, initial[key]) == torch.equal(expected_state[key], initial[key]), key
            assert (value - expected_state[key]).abs().max() <= PARAM_TOL, key
        trained = [k for k, v in state.items() if not torch.equal(v, initial[k])]
        assert any(k.startswith("model.vision.") for k in trained) and any(
            k.startswith("model.projector.") for k in trained
        )
        # The rank's own replica of the encoder side (the state above is global rank 0's, copied to every rank).
        replica = torch.load(runs / f"{name}_rank{rank}.pt")["encoder_state"]
        for key, value in replica.items():
            assert (value - expected_state[key]).abs().max() <= PARAM_TOL, (rank, key)


def test_pipeline_places_the_encoder_side(runs):
    """Spread (the default): both stages hold the encoder side and step it; first_stage: the first only."""
    spread = [torch.load(runs / f"pp2_rank{r}.pt") for r in (0, 1)]
    first = [torch.load(runs / f"pp2_first_stage_rank{r}.pt") for r in (0, 1)]
    assert all(run["decoupled"] for run in spread + first)
    assert [run["spread"] for run in spread + first] == [True, True, False, False]
    assert [run["encoders"] for run in spread] == [["projector", "vision"]] * 2
    assert [run["encoders"] for run in first] == [["projector", "vision"], []]
    assert [len(run["encoder_state"]) for run in spread] == [len(first[0]["encoder_state"])] * 2
    model = build_module().model
    encoder_params = sum(
        1 for m in (model.vision, model.projector) for p in m.parameters() if p.requires_grad
    )
    # the last stage steps its LLM layers, and with the spread encoder side its replica too
    assert spread[1]["optimizer_params"] == first[1]["optimizer_params"] + encoder_params
    assert spread[0]["optimizer_params"] == first[0]["optimizer_params"]
    # megatron's gradient norm counts the replicas once (the later stage's are marked `shared`)
    norms = {name: _losses(runs, name, "train/grad_norm") for name in ("pp2", "pp2_first_stage")}
    assert len(norms["pp2"]) == 3 and norms["pp2"] == pytest.approx(norms["pp2_first_stage"], rel=1e-6)
    tp = [torch.load(runs / f"tp2_rank{r}.pt") for r in (0, 1)]
    assert not tp[0]["decoupled"] and tp[0]["encoders"] == tp[1]["encoders"] == ["projector", "vision"]


def test_pipeline_stages_encode_their_share(runs):
    """The samples each rank's encoder saw: spread, each stage its run of every step (training: the step's 3 x 3
    samples, 4 and 5; evaluation: a batch of 3, 1 and 2), none twice; first_stage, the first stage all of them; at TP 2
    each rank ceil(3 / 2) of every micro-batch (the second pads with a copy)."""
    steps, val_batches = 3, 3 * 2  # 2 validation batches after each of the 3 steps
    train_shares = [sum(len(rows) for _, rows in step_shares([3, 3, 3], r, 2)) for r in (0, 1)]
    eval_shares = [sum(len(rows) for _, rows in step_shares([3], r, 2)) for r in (0, 1)]
    assert train_shares == [4, 5] and eval_shares == [1, 2]
    spread = [torch.load(runs / f"pp2_rank{r}.pt")["encoded_samples"] for r in (0, 1)]
    assert spread == [
        {"train": steps * train_shares[r], "eval": val_batches * eval_shares[r]} for r in (0, 1)
    ]
    first = [torch.load(runs / f"pp2_first_stage_rank{r}.pt")["encoded_samples"] for r in (0, 1)]
    assert first == [{"train": steps * 9, "eval": val_batches * 3}, {}]
    tp = [torch.load(runs / f"tp2_rank{r}.pt")["encoded_samples"] for r in (0, 1)]
    assert tp == [{"train": steps * 3 * 2, "eval": val_batches * 2}] * 2


def test_encoder_placement_is_checked():
    assert parse_placement(None, 2) == "spread" and parse_placement("first_stage", 4) == "first_stage"
    with pytest.raises(ValueError, match="encoder_placement must be one of"):
        parse_placement("last_stage", 2)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size is 1"):
        parse_placement("spread", 1)


def test_pipeline_checkpoint_loads_at_another_layout(runs):
    """pp2's checkpoint after its last step (the encoder side, held by both stages, written once by the first; the
    LLM by both) validates at TP 2 to pp2's own val/loss after that step."""
    assert _losses(runs, "validate_pp2_at_tp2", "val/loss") == {0: _losses(runs, "pp2", "val/loss")[2]}


# ----------------------------------------------------------------------------------------------- the composition


def test_composition_gives_the_native_decoder_inputs():
    """encode + merge equal the native model's input embeddings, also when the samples are encoded in parts."""
    module = build_module()
    model = module.model
    batch = collate(samples(6))
    native_BSH = _native_inputs(model, batch)
    tokens_BSH = model.llm.model.embed_tokens(batch["input_ids"])
    merged_BSH, labels = merge(model, tokens_BSH, encode(model, batch), batch)
    assert torch.equal(labels, batch["labels"])
    torch.testing.assert_close(merged_BSH, native_BSH, rtol=0, atol=1e-6)
    rows = [torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5, 5])]  # the second part pads with a repeat
    parts = torch.cat([encode(model, select(model, batch, r)) for r in rows])[:6]
    torch.testing.assert_close(parts, encode(model, batch), rtol=0, atol=1e-6)
    assert select(model, batch, torch.tensor([2, 0]))["pixel_values"].shape[0] == 2  # 2 images + 0 images


def _native_inputs(model, batch):
    """The native model's input of its first decoder layer."""
    seen = []
    handle = model.llm.model.layers[0].register_forward_pre_hook(lambda layer, args: seen.append(args[0]))
    try:
        model.hidden_states(batch["input_ids"], batch["attention_mask"], pixel_values=batch["pixel_values"])
    finally:
        handle.remove()
    return seen[0]


def test_composition_refuses_bad_batches():
    model = build_module().model
    batch = collate(samples(3))
    left = {**batch, "attention_mask": batch["attention_mask"].flip(1)}
    tokens = model.llm.model.embed_tokens(batch["input_ids"])
    with pytest.raises(ValueError, match="must be padded on the right"):
        merge(model, tokens, encode(model, batch), left)
    short = batch["input_ids"].clone()
    short[2, (short[2] == IMAGE_TOKEN).nonzero()[0]] = 5  # one placeholder of sample 2's images removed
    with pytest.raises(ValueError, match="sample 2 of the micro-batch holds 7 image placeholders"):
        select(model, {**batch, "input_ids": short}, torch.tensor([0]))
    with pytest.raises(ValueError, match="input_ids must hold 12 <image> tokens .* but 11 were found"):
        encode(model, {**batch, "input_ids": short})


# ----------------------------------------------------------------------------------------------- refusals


def _build(**degrees) -> MegatronBuild:
    return MegatronBuild(dims=MegatronDims(**degrees), device=torch.device("cpu"), bf16=False)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"components": {"llm": {"lora": {"rank": 4}}}},
            NotImplementedError,
            "components.llm.lora: LoRA is not yet",
        ),
        (
            {"components": {"projector": {"lr": 1e-2}}},
            ValueError,
            r"components.projector.lr \(0.01\) is not applied",
        ),
        (
            {"components": {"vision": {"activation_checkpointing": "full"}}},
            ValueError,
            "set the strategy's components.vision.recompute instead",
        ),
        (
            {"components": {"llm": {"compile": True}}},
            ValueError,
            "nothing is compiled under MegatronStrategy",
        ),
    ],
)
def test_unsupported_settings_are_refused(kwargs, error, match):
    module = VisionLanguageModule(build_module().hparams["config"], **kwargs)
    with pytest.raises(error, match=match):
        module.megatron_model(_build())


def test_pipeline_refuses_a_merge_that_changes_the_text_positions():
    """Under PP the last stage reads ``batch["labels"]``: a merge that prepends the encoder's positions (the
    encoder -> decoder test model's) is refused on the first stage, before the decoder runs."""
    from types import SimpleNamespace

    from encoder_decoder import EncoderConfig, EncoderDecoderLM
    from encoder_decoder import samples as encoder_samples

    from forge_lightning.modules.llm.loss import LMLoss
    from forge_lightning.modules.llm.megatron.steps import composed_forward_step

    module = EncoderDecoderLM()
    plan = module.parallel_plan()
    items = encoder_samples(2, EncoderConfig(), vocab_size=256)
    batch = {k: torch.stack([item[k] for item in items]) for k in items[0]}
    first_stage = SimpleNamespace(
        decoder=None,
        pre_process=True,
        config=SimpleNamespace(pipeline_model_parallel_size=2),
        embedding=SimpleNamespace(word_embeddings=module.model.llm.model.embed_tokens),
    )
    with pytest.raises(ValueError, match="needs a composition whose merge keeps the text positions"):
        composed_forward_step(batch, first_stage, LMLoss(), plan.composition, plan.composition.encode)


def test_any_resolution_towers_are_refused_with_the_reason() -> None:
    from forge_lightning.modules.vlm.megatron import check_supported

    vision = {
        "type": "siglip_anyres",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_layers": 2,
        "num_heads": 2,
    }
    vision |= {
        "image_size": 16,
        "patch_size": 4,
        "image_grid_pinpoints": [[16, 16], [16, 32], [32, 16], [32, 32]],
    }
    llm = {"model_type": "qwen2", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96}
    llm |= {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    module = VisionLanguageModule(
        {"vision": vision, "llm": llm, "image_token_id": 290, "video_token_id": 291}
    )
    with pytest.raises(NotImplementedError, match="different numbers of tokens"):
        check_supported(module)
