"""The capability table, and every device decision that asks it: a ``cuda`` device registered as Kunlun gets the
torch references, no compile, portable SDPA and foreach Adam, and the switches it cannot run are refused by name;
an unregistered ``cuda`` device keeps NVIDIA's choices."""

import dataclasses

import pytest
import torch

from forge_lightning.accelerators.capabilities import (
    CPU,
    KUNLUN,
    NVIDIA,
    capabilities,
    refuses_unsupported,
    register_platform,
    registered_platforms,
    unregister_platform,
)
from forge_lightning.callbacks.throughput import ThroughputMonitor
from forge_lightning.kernels import _dispatch, flash4
from forge_lightning.modules.layers.attention import resolve_attention_backend
from forge_lightning.optim.param_groups import OptimizerConfig, optimizer_for_groups
from forge_lightning.performance import PerformanceConfig, resolve
from forge_lightning.strategies.megatron.optimizer import _choose_kernels as choose_kernels

KERNELS = ("rms_norm", "rope", "swiglu", "cross_entropy")


@pytest.fixture(autouse=True)
def _no_platform_left_registered():
    yield
    for device_type in list(registered_platforms()):
        unregister_platform(device_type)


@pytest.fixture
def kunlun_cuda():
    """``cuda`` devices are Kunlun XPUs (the vendor's CUDA-compatible mode)."""
    register_platform("cuda", KUNLUN)


def test_capabilities_by_device_type():
    assert capabilities("cuda") is NVIDIA and capabilities(torch.device("cuda", 3)) is NVIDIA
    assert capabilities("cpu") is CPU and capabilities(torch.device("cpu")) is CPU
    other = capabilities("xpu")  # Intel's device type: nothing assumed
    assert other.platform == "xpu" and other.autocast_dtype is None and other.peak_bf16_tflops is None
    flags = (
        "triton",
        "compile",
        "fp8",
        "cudnn_attention",
        "flash_attention",
        "fused_optimizer",
        "grouped_mm",
    )
    assert not any(getattr(other, name) for name in (*flags, "cuda_streams", "bf16"))
    assert all(getattr(NVIDIA, name) for name in flags) and NVIDIA.peak_bf16_tflops == 989.0
    assert not any(getattr(KUNLUN, name) for name in flags)
    assert KUNLUN.bf16 and KUNLUN.autocast_dtype == torch.bfloat16 and KUNLUN.peak_bf16_tflops is None


def test_register_and_unregister_a_platform():
    register_platform("cuda", KUNLUN)
    register_platform("cuda", KUNLUN)  # the same platform again: no-op (setup_device runs per fit)
    assert capabilities("cuda:1") is KUNLUN and registered_platforms() == {"cuda": "kunlun"}
    assert capabilities("cpu") is CPU
    with pytest.raises(
        ValueError, match=r"'cuda' is already registered as platform 'kunlun'.*unregister_platform"
    ):
        register_platform("cuda", NVIDIA)
    with pytest.raises(ValueError, match=r"device_type \('cuda:0'\) must be a bare torch device type"):
        register_platform("cuda:0", KUNLUN)
    unregister_platform("cuda")
    unregister_platform("cuda")  # nothing registered: no-op
    assert capabilities("cuda") is NVIDIA and registered_platforms() == {}


def test_resolve_on_nvidia_is_unchanged():
    # The choices resolve made by device type before the capability table (tests/test_performance.py has more).
    compiled = resolve(PerformanceConfig(), "cuda")
    assert compiled.kernels == {
        "rms_norm": "torch",
        "rope": "torch",
        "swiglu": "torch",
        "cross_entropy": "triton",
    }
    assert (compiled.compile, compiled.optimizer, compiled.fp8) == (True, "fused", None)
    assert compiled.sdpa == ["cudnn", "flash", "efficient", "math"]
    eager = resolve(PerformanceConfig(compile=False), "cuda")
    assert eager.kernels == dict.fromkeys(KERNELS, "triton")
    # What an NVIDIA GPU takes is accepted (FA4 needs a real GPU, so it is left out here).
    explicit = PerformanceConfig(
        kernels=dict.fromkeys(KERNELS, "triton"),
        compile=True,
        fp8={"recipe": "tensorwise"},
        attention={"sdpa": ["cudnn", "flash"], "packed": "varlen"},
        optimizer="fused",
    )
    resolved = resolve(explicit, "cuda")
    assert resolved.fp8 is not None and resolved.packed == "varlen" and resolved.optimizer == "fused"


def test_resolve_on_kunlun_picks_what_the_xpu_runs(kunlun_cuda):
    for compile_ in ("auto", False):
        resolved = resolve(PerformanceConfig(compile=compile_), "cuda:0")
        assert resolved.kernels == dict.fromkeys(KERNELS, "torch")
        assert (resolved.compile, resolved.optimizer, resolved.fp8) == (False, "foreach", None)
        assert resolved.sdpa == ["efficient", "math"]
        assert (resolved.attention_kernel, resolved.packed) == ("sdpa", "auto")
        assert "kunlun" in resolved.attention_kernel_note
    # The CPU keeps torch's default SDPA backends; `cuda` stays Kunlun only while registered.
    assert resolve(PerformanceConfig(), "cpu").sdpa is None
    unregister_platform("cuda")
    assert resolve(PerformanceConfig(), "cuda").optimizer == "fused"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"kernels": {"rope": "triton"}}, r"performance.kernels.rope \('triton'\) is not supported on kunlun.*"
         r"set performance.kernels.rope: auto or torch"),
        ({"compile": True}, r"performance.compile \(true\) is not supported on kunlun.*auto or false"),
        ({"fp8": {"recipe": "rowwise"}}, r"performance.fp8 \(recipe 'rowwise'\) is not supported on kunlun.*"
         r"performance.fp8: null"),
        ({"attention": {"sdpa": ["cudnn", "math"]}}, r"performance.attention.sdpa lists \['cudnn'\], not supported "
         r"on kunlun.*'efficient' and 'math'"),
        ({"attention": {"kernel": "fa4"}}, r"performance.attention.kernel 'fa4': FlashAttention-4 needs an NVIDIA "
         r"GPU, and this 'cuda' device is a kunlun device; or set it to 'auto' or 'sdpa'"),
        ({"attention": {"packed": "fa4"}}, r"performance.attention.packed 'fa4'.*kunlun"),
        ({"attention": {"packed": "varlen"}}, r"performance.attention.packed \('varlen'\) is not supported on kunlun"),
        ({"attention": {"packed": "flex"}}, r"performance.attention.packed \('flex'\).*FlexAttention compiles to "
         r"Triton.*auto or sdpa"),
        ({"optimizer": "fused"}, r"performance.optimizer \('fused'\) is not supported on kunlun.*auto or foreach"),
    ],
)  # fmt: skip
def test_kunlun_refuses_what_it_cannot_run_by_switch(kunlun_cuda, overrides, match):
    perf = PerformanceConfig(**overrides)
    with pytest.raises(ValueError, match=match):
        resolve(perf, "cuda")
    if "fa4" not in (perf.attention.kernel, perf.attention.packed):  # FA4 is refused on the CPU as well
        resolve(perf, "cpu")  # the rest is not: interpreter, C++ inductor, torchao's FP8 emulation


def test_refusals_apply_where_the_table_describes_the_platform():
    assert refuses_unsupported("cuda") and not refuses_unsupported("cpu") and not refuses_unsupported("xpu")
    # A device type the table does not describe gets plain torch for `auto`, and its explicit choices are its own.
    resolved = resolve(PerformanceConfig(compile=True, optimizer="fused", fp8={}), "xpu")
    assert (
        resolved.compile
        and resolved.optimizer == "fused"
        and resolved.kernels == dict.fromkeys(KERNELS, "torch")
    )
    register_platform("xpu", KUNLUN)
    assert refuses_unsupported("xpu")
    with pytest.raises(ValueError, match="performance.compile .* not supported on kunlun"):
        resolve(PerformanceConfig(compile=True), "xpu")


def test_simulated_kunlun_on_cpu_takes_the_kunlun_decisions():
    # The simulated runtime's devices are CPU devices registered as Kunlun.
    register_platform("cpu", KUNLUN)
    with pytest.raises(ValueError, match="performance.compile .* not supported on kunlun"):
        resolve(PerformanceConfig(compile=True), "cpu")
    assert resolve(PerformanceConfig(), "cpu").optimizer == "foreach"


def test_triton_decision_follows_the_platform(monkeypatch):
    monkeypatch.setattr(_dispatch, "triton_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    decide = _dispatch.triton_backend_for
    assert decide("auto", {"cuda"}) and decide("triton", {"cuda"})
    assert (
        not decide("auto", {"cpu"}) and not decide("auto", {"cuda", "cpu"}) and not decide("torch", {"cuda"})
    )
    register_platform("cuda", KUNLUN)
    assert not decide("auto", {"cuda"})
    with pytest.raises(
        RuntimeError, match=r"needs Triton, which kunlun devices do not have.*performance.kernels"
    ):
        decide("triton", {"cuda"})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert decide("triton", {"cpu"})  # interpreter tests stay possible beside a Kunlun device
    # The tensor entry point agrees, and empty inputs never launch.
    unregister_platform("cuda")
    assert not _dispatch.use_triton("triton", torch.empty(0))


def test_attention_backends_follow_the_platform(kunlun_cuda):
    cuda = torch.device("cuda")
    assert resolve_attention_backend("auto", cuda) == "sdpa"
    assert resolve_attention_backend("auto", cuda, varying_shapes=True) == "sdpa"
    with pytest.raises(ValueError, match=r"'varlen' needs CUDA \(FlashAttention\).*platform kunlun"):
        resolve_attention_backend("varlen", cuda)
    with pytest.raises(ValueError, match="'flex' compiles FlexAttention to Triton, which kunlun devices"):
        resolve_attention_backend("flex", cuda)
    assert "kunlun device" in flash4.device_unsupported(cuda)
    unregister_platform("cuda")
    assert resolve_attention_backend("auto", cuda) == "flex"
    assert resolve_attention_backend("varlen", cuda) == "varlen"


def test_fused_adamw_under_every_strategy_and_the_mfu_peak_follow_the_platform():
    def adamw_flags() -> tuple[bool, bool]:
        weight = torch.nn.Parameter(torch.randn(4, 4))
        group = optimizer_for_groups([{"params": [weight]}], OptimizerConfig(name="adamw")).param_groups[0]
        return group["fused"], group["foreach"]

    def megatron_flags() -> tuple[bool, bool]:
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.randn(4, 4))])
        choose_kernels(optimizer, "auto")
        return optimizer.param_groups[0]["fused"], optimizer.param_groups[0]["foreach"]

    assert adamw_flags() == (None, True) and megatron_flags() == (False, True)  # CPU: foreach
    register_platform("cpu", dataclasses.replace(CPU, fused_optimizer=True))
    assert adamw_flags() == (True, None) and megatron_flags() == (True, False)
    unregister_platform("cpu")
    monitor = ThroughputMonitor()
    assert monitor._peak(torch.device("cuda")) == 989.0 and monitor._peak(torch.device("cpu")) is None
    register_platform("cuda", KUNLUN)
    assert monitor._peak(torch.device("cuda")) is None
    assert ThroughputMonitor(peak_tflops=300.0)._peak(torch.device("cuda")) == 300.0


def test_capability_decisions_trace_into_compiled_graphs():
    # Attention and MoE forwards ask the table inside compiled blocks: no graph break, and a registration is
    # guarded on (the graph is traced again).
    def decide(x: torch.Tensor) -> torch.Tensor:
        y = x + 1 if capabilities(x.device).flash_attention else x - 1
        return y * 2 if _dispatch.use_triton("auto", x) else y

    compiled = torch.compile(decide, fullgraph=True, backend="eager")
    assert compiled(torch.zeros(2)).tolist() == [-1.0, -1.0]
    register_platform("cpu", dataclasses.replace(CPU, flash_attention=True))
    assert compiled(torch.zeros(2)).tolist() == [1.0, 1.0]
