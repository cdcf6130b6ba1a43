"""Worker of test_performance_switches.py: set up the tiny LLM once per (strategy, ``performance`` value) and record
whether the strategy applied the settings or refused them (with its message).

``python tests/performance_switches_worker.py CASES_JSON OUT_JSON``; each case is ``{"strategy": NAME,
"performance": {...}}``. One process: the native strategies run first, MegatronStrategy last (its CUDA shim is
installed only then). ``Trainer.fit`` with ``max_steps=0`` runs the whole setup (``configure_model``, the strategy's
``setup`` with its transforms or its megatron-core model, the optimizer) and no step.
"""

import json
import logging
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "megatron"))

import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from tiny import TINY_LLM  # noqa: E402

from forge_lightning.modules.llm import CausalLM  # noqa: E402


def _strategy(name: str) -> object:
    from forge_lightning.strategies import DDPStrategy, FSDP2Strategy, MegatronStrategy, ZeRO1Strategy

    return {
        "single_device": lambda: "auto",
        "ddp": lambda: DDPStrategy(process_group_backend="gloo"),
        "zero1": lambda: ZeRO1Strategy(process_group_backend="gloo"),
        "fsdp2": lambda: FSDP2Strategy(process_group_backend="gloo"),
        "megatron": lambda: MegatronStrategy(process_group_backend="gloo"),
    }[name]()


def _loader() -> torch.utils.data.DataLoader:
    ids = torch.randint(0, TINY_LLM["vocab_size"], (4, 17), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": r[:-1], "labels": r[1:]} for r in ids]
    return torch.utils.data.DataLoader(rows, batch_size=2)


def run(case: dict) -> dict:
    module = CausalLM(config=TINY_LLM, performance=case["performance"], scheduler={"total_steps": 1})
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=_strategy(case["strategy"]),
        max_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(module, train_dataloaders=_loader())
    except (ValueError, NotImplementedError) as err:
        return {"outcome": "refused", "message": str(err)}
    return {"outcome": "applied"}


def main(cases_file: Path, out: Path) -> None:
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    cases = json.loads(cases_file.read_text())
    results = []
    shim = False
    for case in sorted(cases, key=lambda c: c["strategy"] == "megatron"):
        if case["strategy"] == "megatron" and not shim:
            import cuda_shim

            cuda_shim.install()
            shim = True
        results.append({**case, **run(case)})
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
