"""megatron-core's MoE communication overlap options under MegatronStrategy: every precondition refused up front
with the option and the fix, and ``moe_shared_expert_overlap`` and ``overlap_moe_expert_parallel_comm`` give the
same losses and gradients as without them at EP = 2 on two gloo processes (``moe_overlap_worker.py``; the CPU
shim's CUDA streams are no-ops, so megatron's overlapped code paths run their parts in order: this checks their
arithmetic and the twin's schedule plan, not their speed)."""

from pathlib import Path

import pytest
import torch
from conftest import torchrun
from moe_reference import moe_config

from forge_lightning.contracts import MegatronBuild, MegatronDims, MoECommOverlap
from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.megatron.twin import check_moe_overlap
from forge_lightning.strategies.megatron import MegatronStrategy

HERE = Path(__file__).resolve().parent
GRAD_RTOL = 1e-5  # max |overlapped - plain| per gradient tensor / its max |plain| (measured <= 6.1e-7)
EP2 = MegatronDims(expert_model_parallel_size=2)
CUDA = torch.device("cuda")

OVERLAP = MoECommOverlap(overlap_moe_expert_parallel_comm=True)


@pytest.mark.parametrize(
    ("overlap", "dims", "run", "match"),
    [
        (
            MoECommOverlap(delay_wgrad_compute=True),
            EP2,
            {},
            "delay_wgrad_compute needs overlap_moe_expert_parallel",
        ),
        (OVERLAP, MegatronDims(), {}, "needs expert_model_parallel_size > 1"),
        (
            OVERLAP,
            MegatronDims(expert_model_parallel_size=2, pipeline_model_parallel_size=2),
            {},
            "set virtual_pipeline_model_parallel_size",
        ),
        (
            MoECommOverlap(overlap_moe_expert_parallel_comm=True, moe_shared_expert_overlap=True),
            EP2,
            {},
            "exclude each other",
        ),
        (OVERLAP, EP2, {"bf16": False, "device": CUDA}, "set trainer.precision to bf16-mixed"),
        (OVERLAP, EP2, {"bf16": True, "recompute": "full", "device": CUDA}, "activation_checkpointing"),
        (OVERLAP, EP2, {"bf16": True, "device": torch.device("cpu")}, "needs a CUDA device"),
        (
            MoECommOverlap(moe_shared_expert_overlap=True),
            MegatronDims(),
            {"device": torch.device("cpu")},
            "moe_shared_expert_overlap needs a CUDA device",
        ),
    ],
)
def test_overlap_preconditions_are_refused_up_front(overlap, dims, run, match):
    with pytest.raises(ValueError, match=match):
        overlap.check(dims, **run)


def test_overlap_options_that_meet_their_preconditions_pass():
    interleaved = MegatronDims(
        expert_model_parallel_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    both = MoECommOverlap(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    both.check(interleaved, device=CUDA, bf16=True, recompute="none")
    MoECommOverlap(moe_shared_expert_overlap=True).check(MegatronDims(), device=CUDA, bf16=False)
    MoECommOverlap().check(MegatronDims(), device=torch.device("cpu"), bf16=False, recompute="full")


def test_strategy_takes_megatron_cores_option_names():
    strategy = MegatronStrategy(
        expert_model_parallel_size=2, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True
    )
    assert strategy.moe_overlap.transformer_config_fields() == {
        "overlap_moe_expert_parallel_comm": True,
        "delay_wgrad_compute": True,
        "moe_shared_expert_overlap": False,
    }


def test_strategy_refuses_them_on_the_cpu_before_any_process_group_is_built():
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.accelerators import CPUAccelerator

    strategy = MegatronStrategy(moe_shared_expert_overlap=True)
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.cluster_environment = LightningEnvironment()
    strategy.accelerator = CPUAccelerator()
    with pytest.raises(ValueError, match="moe_shared_expert_overlap needs a CUDA device.*set it to false"):
        strategy.setup_environment()


def _build(overlap: MoECommOverlap, **kwargs) -> MegatronBuild:
    return MegatronBuild(
        dims=EP2, device=CUDA, bf16=True, use_transformer_engine=False, moe_overlap=overlap, **kwargs
    )


def test_the_twin_refuses_what_its_model_cannot_overlap():
    dense = LLMConfig.from_preset("debug")
    with pytest.raises(ValueError, match="this model has none"):
        check_moe_overlap(dense, _build(OVERLAP))
    no_shared = moe_config("qwen3_moe")
    with pytest.raises(ValueError, match="no shared experts"):
        check_moe_overlap(no_shared, _build(MoECommOverlap(moe_shared_expert_overlap=True)))
    delayed = MoECommOverlap(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    with pytest.raises(ValueError, match="delay_wgrad_compute needs TransformerEngine"):
        check_moe_overlap(no_shared, _build(delayed))
    with pytest.raises(ValueError, match="composed model"):
        check_moe_overlap(no_shared, _build(OVERLAP, composition=object()))
    from forge_lightning.modules.diffusion.megatron import check_layout as check_dit_layout
    from forge_lightning.modules.diffusion.wan_config import WanDiTConfig

    with pytest.raises(ValueError, match="the Wan DiT has none"):  # the other family's twin
        check_dit_layout(WanDiTConfig(), _build(MoECommOverlap(moe_shared_expert_overlap=True)))
    check_moe_overlap(no_shared, _build(OVERLAP))
    check_moe_overlap(moe_config("qwen2_moe"), _build(MoECommOverlap(moe_shared_expert_overlap=True)))


@pytest.mark.parametrize("kind", ["moe_shared_expert_overlap", "overlap_moe_expert_parallel_comm"])
def test_overlap_gives_the_same_losses_and_gradients_at_ep2(overlap_runs, kind):
    """At EP = 2 on two gloo processes, two micro-batches per rank: ``moe_shared_expert_overlap`` (fp32) and
    ``overlap_moe_expert_parallel_comm`` (bf16: megatron's combined 1F1B schedule, the forward step handing it the
    twin's schedule plan) give the losses and gradients of the same twin without them."""
    for name in NAMES:
        plain, overlapped = overlap_runs[name, kind, False], overlap_runs[name, kind, True]
        if kind == "moe_shared_expert_overlap":
            assert overlapped["shared_overlap"] == [True] and plain["shared_overlap"] == [False], name
        else:
            assert overlapped["expert_overlap"] and not plain["expert_overlap"], name
        torch.testing.assert_close(overlapped["sums"], plain["sums"], rtol=1e-7, atol=1e-6)
        assert sorted(overlapped["grads"]) == sorted(plain["grads"])
        rel = {
            k: (
                (g.float() - plain["grads"][k].float()).abs().max() / plain["grads"][k].float().abs().max()
            ).item()
            for k, g in overlapped["grads"].items()
        }
        worst = max(rel, key=rel.get)
        assert rel[worst] <= GRAD_RTOL, (name, worst, rel[worst])


NAMES = ["qwen2_moe", "deepseek_v3"]  # a gated shared expert; an ungated one beside MLA and sigmoid routing


@pytest.fixture(scope="module")
def overlap_runs(tmp_path_factory):
    """One launch of ``moe_overlap_worker.py`` for both options and both models."""
    out = tmp_path_factory.mktemp("moe_overlap") / "runs.pt"
    torchrun(HERE / "moe_overlap_worker.py", out, *NAMES)
    return torch.load(out)
