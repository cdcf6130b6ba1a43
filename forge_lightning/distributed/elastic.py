"""A clean process-group rendezvous for workers that torchelastic restarted (``torchrun --max-restarts N``).

torchelastic keeps one key-value store for the whole job and points every attempt's workers at it
(``TORCHELASTIC_USE_AGENT_STORE=True``), while ``init_process_group`` writes its keys (each rank's gloo address,
NCCL's unique id) under the same names in every attempt. A restarted rank can then read the address a dead rank of
the previous attempt published: on gloo, measured here, "connectFullMesh failed ... Connection refused", or a
hang. :func:`fresh_store_after_restart` gives each restarted attempt a store of its own: global rank 0 opens a new
one on a free port of its host and publishes the port in the job's store under a key named after the attempt, which
nothing wrote before; every rank then initialises its process group from it.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

from forge_lightning.resume import elastic_restart_count

STORE_TIMEOUT = timedelta(minutes=10)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def fresh_store_after_restart() -> int | None:
    """On a worker that torchelastic restarted, point ``MASTER_PORT`` at a store opened for this attempt (see the
    module docstring) and return its port; do nothing and return None on a first attempt or outside torchrun.

    Call it in every worker before the process group is initialised.
    """
    restarts = elastic_restart_count()
    if restarts == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return None
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    job_store = dist.TCPStore(address, port, world_size, is_master=False, timeout=STORE_TIMEOUT)
    key = f"forge/elastic/attempt_{restarts}/master_port"
    if rank == 0:
        job_store.set(key, str(_free_port()))
    fresh = int(job_store.get(key))
    os.environ["MASTER_PORT"] = str(fresh)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(False)  # global rank 0 hosts this attempt's store
    return fresh
