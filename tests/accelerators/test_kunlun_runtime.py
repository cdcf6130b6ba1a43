"""The Kunlun runtimes and ``KunlunAccelerator`` without the hardware: the real runtime against a stand-in
``torch_xmlir`` that records its calls (both modes), the simulated runtime, device parsing, the registry name,
the capability registration and the strategies' backend / DeviceMesh choice."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import SingleDeviceStrategy

from forge_lightning.accelerators import (
    KUNLUN,
    KunlunAccelerator,
    MemoryStats,
    SimulatedRuntime,
    XmlirRuntime,
    capabilities,
)
from forge_lightning.accelerators.runtime import check_torch_version
from forge_lightning.contracts import (
    DistributedDevices,
    MeasuredDevices,
    device_mesh_type,
    process_group_backend,
)
from forge_lightning.strategies import DDPStrategy, FSDP2Strategy, ZeRO1Strategy


def test_real_runtime_goes_through_the_vendor_api(xmlir):
    runtime = XmlirRuntime()
    device_type = "cuda" if xmlir.mode == "cuda" else xmlir.privateuse1_name
    assert runtime.device_type == device_type
    assert runtime.name == (
        "xmlir (cuda-compatible)" if xmlir.mode == "cuda" else f"xmlir (privateuse1: {device_type})"
    )
    assert runtime.process_group_backend == ("nccl" if xmlir.mode == "cuda" else "kccl")
    assert runtime.version == "1.0.0.1"
    assert runtime.is_available() and runtime.device_count() == xmlir.devices
    runtime.set_device(3)
    assert runtime.current_device() == 3
    runtime.synchronize(3)
    runtime.synchronize()
    assert runtime.memory_stats(3) == MemoryStats(allocated=3 << 30, reserved=4 << 30, peak_allocated=5 << 30)
    runtime.reset_peak_memory_stats(3)
    runtime.manual_seed_all(7)
    assert runtime.device_name(3) == "KL3"  # the vendor's name, not the CUDA shim's "GPU"
    assert xmlir.calls == [
        ("device_count",),
        ("device_count",),
        ("set_device", 3),
        ("current_device",),
        ("synchronize", 3),
        ("synchronize",),
        ("memory_allocated", 3),
        ("memory_reserved", 3),
        ("max_memory_allocated", 3),
        ("reset_peak_memory_stats", 3),
        ("manual_seed_all", 7),
        ("xpu.get_device_name", 3),
    ]


def test_privateuse1_without_a_registered_backend_is_refused(xmlir, monkeypatch):
    if xmlir.mode == "cuda":
        assert XmlirRuntime().process_group_backend == "nccl"
        return
    monkeypatch.delitem(torch.distributed.Backend.default_device_backend_map, xmlir.privateuse1_name)
    with pytest.raises(RuntimeError, match="no process-group backend for device type 'kunlunxpu'"):
        _ = XmlirRuntime().process_group_backend


def test_missing_torch_xmlir_says_what_to_install(no_xmlir):
    assert not XmlirRuntime().is_available()  # Lightning asks every registered accelerator: never raises
    assert not KunlunAccelerator.is_available()
    for runtime in ("auto", "xmlir"):
        with pytest.raises(ImportError, match=r"install xpytorch \(Python module torch_xmlir, with BKCL\)"):
            KunlunAccelerator(runtime=runtime)
    with pytest.raises(ImportError, match="runtime: simulated"):
        # The registry name resolves to the accelerator.
        Trainer(accelerator="kunlun", devices=1, logger=False)


def test_registry_name_and_unknown_runtime(xmlir_cuda):
    assert AcceleratorRegistry["kunlun"]["accelerator"] is KunlunAccelerator
    accelerator = AcceleratorRegistry.get("kunlun")
    assert isinstance(accelerator.runtime, XmlirRuntime) and accelerator.runtime.device_type == "cuda"
    assert KunlunAccelerator.get_parallel_devices([0, 1]) == [
        torch.device("cuda", 0),
        torch.device("cuda", 1),
    ]
    with pytest.raises(
        ValueError, match=r"runtime must be one of \('auto', 'xmlir', 'simulated'\), got 'xpu'"
    ):
        KunlunAccelerator(runtime="xpu")
    with pytest.raises(ValueError, match=r"num_devices \(0\) must be at least 1"):
        KunlunAccelerator(runtime="simulated", simulated_devices=0)


@pytest.mark.parametrize(
    ("devices", "expected"),
    [(1, [0]), (3, [0, 1, 2]), (-1, list(range(4))), ("auto", list(range(4))), ("-1", list(range(4))),
     ("2", [0, 1]), ("1,3", [1, 3]), ([2, 0], [2, 0]), ((3,), [3])],
)  # fmt: skip
def test_parse_devices(devices, expected):
    KunlunAccelerator(runtime="simulated", simulated_devices=4)
    assert KunlunAccelerator.parse_devices(devices) == expected
    assert KunlunAccelerator.auto_device_count() == 4


@pytest.mark.parametrize(
    ("devices", "match"),
    [(0, "selects no Kunlun device"), (5, r"more Kunlun devices than this process sees \(4\)"),
     (-2, "positive count or -1"), ([1, 1], "repeats a device index"), ([0, 4], r"indices \[4\] are out of range"),
     ("a,b", "comma-separated indices"), ("two", "comma-separated indices"), (True, "a count, -1, 'auto'"),
     (1.5, "a count, -1, 'auto'"), ([], "selects no Kunlun device")],
)  # fmt: skip
def test_parse_devices_refuses_bad_input(devices, match):
    KunlunAccelerator(runtime="simulated", simulated_devices=4)
    with pytest.raises(ValueError, match=match):
        KunlunAccelerator.parse_devices(devices)


def test_setup_device_registers_kunlun_and_seeds_then_teardown_unregisters(xmlir_cuda):
    accelerator = KunlunAccelerator(runtime="xmlir")
    torch.manual_seed(1234)
    assert capabilities("cuda").platform == "nvidia"
    with pytest.raises(ValueError, match=r"runs on 'cuda' devices, got meta"):
        accelerator.setup_device(torch.device("meta"))
    accelerator.setup_device(torch.device("cuda", 2))
    assert capabilities("cuda:2") == KUNLUN  # Triton, compile, FP8, cuDNN / FlashAttention off from here on
    assert ("set_device", 2) in xmlir_cuda.calls and ("manual_seed_all", 1234) in xmlir_cuda.calls
    assert accelerator.get_device_stats("cuda:2") == {
        "memory_allocated": 3 << 30,
        "memory_reserved": 4 << 30,
        "memory_peak_allocated": 5 << 30,
    }
    assert accelerator.peak_memory_bytes(torch.device("cuda", 2)) == 5 << 30
    accelerator.synchronize(torch.device("cuda", 2))
    assert xmlir_cuda.calls[-1] == ("synchronize", 2)
    accelerator.teardown()
    assert capabilities("cuda").platform == "nvidia"


def test_one_device_run_moves_off_lightnings_host_default(xmlir_cuda):
    """Lightning builds a one-device run of an accelerator it does not know on ``cpu``; setup moves it."""
    accelerator = KunlunAccelerator(runtime="xmlir")
    strategy = SingleDeviceStrategy(device="cpu", accelerator=accelerator)
    accelerator.setup_device(strategy.root_device)
    assert capabilities("cuda").platform == "kunlun" and not xmlir_cuda.calls
    plugin = MixedPrecision("bf16-mixed", device="cpu")
    trainer = SimpleNamespace(
        strategy=strategy,
        precision_plugin=plugin,
        _accelerator_connector=SimpleNamespace(_parallel_devices=[torch.device("cuda", 3)]),
    )
    accelerator.setup(trainer)
    assert strategy.root_device == torch.device("cuda", 3) and plugin.device == "cuda"
    assert xmlir_cuda.calls[0] == ("set_device", 3)
    assert xmlir_cuda.calls[-1] == ("reset_peak_memory_stats", 3)


def test_simulated_runtime_records_and_leaves_the_host_generator_alone():
    runtime = SimulatedRuntime(num_devices=2)
    state = torch.random.get_rng_state()
    runtime.manual_seed_all(5)
    assert torch.equal(torch.random.get_rng_state(), state)
    runtime.set_device(1)
    assert runtime.current_device() == 1 and runtime.device_name(1) == "simulated Kunlun XPU 1"
    with pytest.raises(ValueError, match="device index 2 is out of range: the simulation has 2 devices"):
        runtime.set_device(2)
    stats = runtime.memory_stats(1)
    assert stats.peak_allocated is not None and stats.peak_allocated > 0
    assert runtime.calls == [("manual_seed_all", 5), ("set_device", 1), ("memory_stats", 1)]


def test_strategies_take_backend_and_mesh_type_from_the_accelerator(xmlir):
    accelerator = KunlunAccelerator(runtime="xmlir")
    assert isinstance(accelerator, DistributedDevices) and isinstance(accelerator, MeasuredDevices)
    # torch makes devices of a renamed PrivateUse1 type only after a real rename: its own name stands in.
    device = torch.device("cuda" if xmlir.mode == "cuda" else "privateuseone", 0)
    backend = "nccl" if xmlir.mode == "cuda" else "kccl"
    assert process_group_backend(accelerator, device) == backend
    assert device_mesh_type(accelerator, device) == accelerator.runtime.device_type
    # Lightning's own accelerators: Lightning's default (a PrivateUse1 device would get gloo).
    assert process_group_backend(object(), torch.device("cpu")) == "gloo"
    for strategy in (DDPStrategy(), ZeRO1Strategy(), FSDP2Strategy()):
        strategy.accelerator = accelerator
        strategy.parallel_devices = [device]
        assert strategy._get_process_group_backend() == backend
    explicit = DDPStrategy(process_group_backend="gloo")
    explicit.accelerator = accelerator
    explicit.parallel_devices = [device]
    assert explicit._get_process_group_backend() == "gloo"


@pytest.mark.parametrize("version", ["2.5.1", "2.5.1+xmlir", "1.13.0"])
def test_a_vendor_torch_older_than_the_minimum_is_refused_with_both_versions(version):
    with pytest.raises(
        RuntimeError, match=rf"built on torch {re.escape(version)}; forge-lightning needs torch >= 2.6"
    ):
        check_torch_version(version)


@pytest.mark.parametrize("version", ["2.6.0", "2.13.0+cpu", "3.0.0"])
def test_a_supported_vendor_torch_passes(version):
    check_torch_version(version)
