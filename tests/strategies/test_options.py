"""Strategy options, degree validation, registry names and errors raised before any process starts."""

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

import forge_lightning.strategies as strategies
from forge_lightning.contracts import Component, ParallelPlan, StrategyTraits, traits_of
from forge_lightning.strategies.fsdp2 import FSDPDims
from forge_lightning.strategies.parallelize import check_unsharded


@pytest.mark.parametrize(
    ("name", "cls", "init"),
    [
        ("fsdp2", strategies.FSDP2Strategy, {}),
        ("hsdp", strategies.FSDP2Strategy, {"data_parallel_replicate_size": "auto"}),
        ("zero1", strategies.ZeRO1Strategy, {}),
        ("ddp_bf16", strategies.DDPStrategy, {"comm_hook": "bf16"}),
        ("ddp_fp8", strategies.DDPStrategy, {"comm_hook": "fp8"}),
        ("megatron", strategies.MegatronStrategy, {}),
    ],
)
def test_registered_short_names(name, cls, init):
    entry = StrategyRegistry[name]
    assert entry["strategy"] is cls and entry["init_params"] == init


@pytest.mark.parametrize(
    ("strategy", "traits"),
    [
        ("fsdp2", StrategyTraits(owns_checkpoint_io=True, applies_performance=True, shards_model=True)),
        (
            "megatron",
            StrategyTraits(
                owns_checkpoint_io=True,
                reads_pretrained_shards=True,
                applies_performance=True,
                shards_model=True,
            ),
        ),
        ("zero1", StrategyTraits()),
        ("ddp_fp8", StrategyTraits()),
        ("ddp", StrategyTraits()),  # Lightning's own: all traits off
        ("auto", StrategyTraits()),
    ],
)
def test_every_strategy_declares_its_traits(strategy, traits):
    """The CLI reads the traits of a strategy given by name or class before building it (checkpoint I/O, deferred
    pretrained weights)."""
    from forge_lightning.cli import strategy_traits

    assert strategy_traits(strategy) == traits
    cls = StrategyRegistry[strategy]["strategy"] if strategy in StrategyRegistry else None
    if cls is not None:
        assert traits_of(cls) == traits


@pytest.mark.parametrize(
    ("world", "dp", "replicate", "tp", "resolved"),
    [(8, "auto", 1, 2, 4), (8, 4, 2, 2, 4), (2, 2, 2, 1, 2), (1, "auto", 1, 1, 1)],
)
def test_degrees_resolve(world, dp, replicate, tp, resolved):
    assert validate_degrees(world, dp, replicate, tp) == resolved


def validate_degrees(world: int, dp: int | str, replicate: int, tp: int) -> int:
    dims = FSDPDims(data_parallel_size=dp, data_parallel_replicate_size=replicate, tensor_parallel_size=tp)
    return dims.validate(world)


@pytest.mark.parametrize(
    ("world", "dp", "replicate", "tp", "message"),
    [
        (8, 3, 1, 2, "must equal the world size"),
        (8, 4, 3, 2, "data_parallel_replicate_size must divide"),
        (8, "auto", 1, 0, "at least 1"),
    ],
)
def test_bad_degrees_name_every_degree(world, dp, replicate, tp, message):
    with pytest.raises(ValueError, match=message) as err:
        validate_degrees(world, dp, replicate, tp)
    for degree in (
        "data_parallel_size",
        "data_parallel_replicate_size",
        "tensor_parallel_size",
        "world size",
    ):
        assert degree in str(err.value)


def test_properties_raise_before_setup():
    strategy = strategies.FSDP2Strategy()
    with pytest.raises(RuntimeError, match="data_parallel_size is only known after"):
        _ = strategy.data_parallel_size
    with pytest.raises(RuntimeError, match="data_parallel_rank is only known after"):
        _ = strategy.data_parallel_rank


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"param_dtype": "bf15"}, "param_dtype must be one of"),
        ({"reduce_dtype": "int8"}, "reduce_dtype must be one of"),
    ],
)
def test_fsdp2_rejects_unknown_dtypes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        strategies.FSDP2Strategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"comm_hook": "int4"}, "comm_hook must be one of"),
        ({"comm_hook": "bf16", "error_feedback": True}, "error_feedback applies to comm_hook='fp8' only"),
    ],
)
def test_ddp_rejects_bad_hook_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        strategies.DDPStrategy(**kwargs)


def test_ddp_bucket_defaults_and_overrides():
    """Gradients as bucket views and 100 MB buckets unless the YAML / caller says otherwise."""
    assert strategies.DDPStrategy()._ddp_kwargs == {"gradient_as_bucket_view": True, "bucket_cap_mb": 100}
    kwargs = strategies.DDPStrategy(
        gradient_as_bucket_view=False, bucket_cap_mb=25, static_graph=True
    )._ddp_kwargs
    assert kwargs == {"gradient_as_bucket_view": False, "bucket_cap_mb": 25, "static_graph": True}


def test_only_frozen_components_may_stay_unsharded():
    plan = ParallelPlan(
        components=[
            Component(name="vision", module=nn.Linear(2, 2), frozen=True),
            Component(name="llm", module=nn.Linear(2, 2)),
        ]
    )
    assert [c.name for c in check_unsharded(plan, ["vision"])] == ["vision"]
    with pytest.raises(ValueError, match="component 'llm' is trainable"):
        check_unsharded(plan, ["llm"])
    with pytest.raises(ValueError, match="names 'audio'"):
        check_unsharded(plan, ["audio"])


def test_fp8_byte_formula_is_half_a_bf16_ring_all_reduce():
    from forge_lightning.strategies.comm import fp8_all_reduce_bytes

    n, world = 2**24, 8
    bf16_ring = 2 * (world - 1) * n * 2 // world
    assert fp8_all_reduce_bytes(n, world) / bf16_ring == pytest.approx((1 + 4 / 256) / 2)  # 0.508
    assert torch.float8_e4m3fn  # the FP8 dtype exists in this torch
