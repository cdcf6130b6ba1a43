"""The end of a multi-process test worker whose results are already written."""

import json
import multiprocessing
import os
import sys


def exit_worker() -> None:
    """Leave without the process group's and the interpreter's teardown, in which gloo can abort.

    On CPU / gloo (torch 2.13) a process occasionally aborts at interpreter shutdown, after all its work, with
    "terminate called without an active exception" from a C++ thread destructor; ``os._exit`` skips that
    teardown. It also skips the exit hooks that would stop multiprocessing children (megatron-core's checkpoint
    writer keeps a manager process for its write results), so those are stopped here first.
    """
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def finish_worker(out: str, rank: int, results: dict) -> None:
    """Write this rank's ``results`` to ``out/rank{rank}.json`` (what ``procs.run_workers`` reads) and leave
    through :func:`exit_worker`."""
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    exit_worker()
