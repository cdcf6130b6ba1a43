"""Fixtures of the strategy tests."""

import socket

import pytest
import torch.distributed as dist


@pytest.fixture
def one_process_group():
    """A one-process gloo world for the test (the existing one, if a test already started it)."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
