"""2-process worker: a tiny LLaVA-type ``VisionLanguageModule`` (SigLIP tower + MLP projector + Llama) under
MegatronStrategy, one ``Trainer.fit`` per case in the same processes (megatron-core is imported once).

``python -m torch.distributed.run --nproc-per-node 2 vlm_worker.py OUT_DIR CASE...`` (gloo, CPU shim; cases from
:data:`CASES`). Each case writes its CSV log under ``OUT_DIR/CASE`` (global rank 0) and, per rank,
``OUT_DIR/CASE_rank{r}.pt``: the module's state dict after the fit (the strategy copies the trained weights into
it), the encoder-side components this rank held, their weights on this rank (its replica, before that copy), the
samples it encoded in training and evaluation and the number of parameters its optimizer steps.
test_vlm.py compares them with the same module trained on one process.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from components_worker import main, trainer_kwargs
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from forge_lightning.modules.vlm import VisionLanguageModule
from forge_lightning.modules.vlm.siglip import PRESETS as SIGLIP_PRESETS

SEED = 11
IMAGE_TOKEN = 3
VISION = {"type": "siglip", **SIGLIP_PRESETS["debug"], "patch_size": 8}  # 3 layers on 16 x 16 images
TOKENS_PER_IMAGE = 4  # (16 / 8) ** 2
SEQ = 16
# strategy: MegatronStrategy options; batch 3 and accumulate 3: the second TP rank pads its share, and 1F1B runs a
# warm-up, a steady state and a cool-down over the step's 3 micro-batches. DP = 1 in both: the global batch is the
# one-process reference's.
# pp2 spreads the encoder side over both stages (the default), pp2_first_stage keeps it on the first. pp2 also saves
# a checkpoint after its last step (the encoder side written once, by the first stage), which validate_pp2_at_tp2
# loads at TP 2 for Trainer.validate.
CASES = {
    "tp2": dict(strategy=dict(tensor_model_parallel_size=2, components={"vision": {"recompute": "full"}})),
    "pp2": dict(strategy=dict(pipeline_model_parallel_size=2), checkpoint=True),
    "pp2_first_stage": dict(strategy=dict(pipeline_model_parallel_size=2, encoder_placement="first_stage")),
    "validate_pp2_at_tp2": dict(strategy=dict(tensor_model_parallel_size=2), validate="pp2"),
}
BATCH, ACCUMULATE = 3, 3
CKPT = "epoch=0-step=3.ckpt"


def build_module() -> VisionLanguageModule:
    pl.seed_everything(SEED, verbose=False)
    config = {"vision": VISION, "projector": "mlp", "llm": "debug", "image_token_id": IMAGE_TOKEN}
    return VisionLanguageModule(config, optimizer={"lr": 1e-3}, scheduler={"name": "constant"})


def samples(count: int, vocab_size: int = 256) -> list[dict[str, torch.Tensor]]:
    """Samples of 0, 1 or 2 images (in turn) at a varying place in the text, right padding on every third."""
    g = torch.Generator().manual_seed(SEED)
    out = []
    for i in range(count):
        images = i % 3
        ids = torch.randint(4, vocab_size, (SEQ + 1,), generator=g)
        start = 1 + i % 4
        ids[start : start + images * TOKENS_PER_IMAGE] = IMAGE_TOKEN
        labels = ids[1:].clone()
        labels[ids[1:] == IMAGE_TOKEN] = -100
        mask = torch.ones(SEQ, dtype=torch.long)
        if i % 3 == 1:  # right padding
            mask[-3:] = 0
            labels[-3:] = -100
        pixels = torch.randn(images, 3, 16, 16, generator=g)
        out.append({"input_ids": ids[:-1], "labels": labels, "attention_mask": mask, "pixel_values": pixels})
    return out


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Text stacked per sample, the images of all samples in order (as VLMDataModule gives them)."""
    batch = {k: torch.stack([item[k] for item in items]) for k in ("input_ids", "labels", "attention_mask")}
    batch["pixel_values"] = torch.cat([item["pixel_values"] for item in items])
    return batch


def data() -> DataLoader:
    """The samples in order. A sampler of one replica (DP = 1 in every case): Lightning would otherwise give a plain
    loader a shuffling DistributedSampler under MegatronStrategy."""
    dataset = samples(36)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler, collate_fn=collate)


def fit_kwargs(out: Path, name: str) -> dict:
    return trainer_kwargs(out, name, ACCUMULATE)


def run_case(out: Path, name: str) -> None:
    from forge_lightning.strategies.megatron import MegatronStrategy
    from forge_lightning.strategies.megatron.optimizer import torch_optimizers

    module = build_module()
    held: dict[str, object] = {}

    class _Inspect(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            parts = trainer.strategy._components
            held["encoders"] = sorted(parts.encoder_modules())
            held["encoder_state"] = {
                f"model.{name}.{k}": v.detach().cpu().clone()
                for name, sub in parts.encoder_modules().items()
                for k, v in sub.state_dict().items()
            }
            held["encoded_samples"] = dict(parts.encoded_samples)
            held["decoupled"], held["spread"] = parts.decoupled, parts.spread
            inner = torch_optimizers(trainer.strategy.optimizers[0])
            held["optimizer_params"] = sum(len(g["params"]) for opt in inner for g in opt.param_groups)

    case = CASES[name]
    kwargs = fit_kwargs(out, name)
    callbacks: list[pl.Callback] = [_Inspect()]
    if case.get("checkpoint"):
        kwargs["enable_checkpointing"] = True
        callbacks.append(ModelCheckpoint(dirpath=out / f"ckpt_{name}", every_n_train_steps=3, save_top_k=-1))
    trainer = pl.Trainer(
        devices=2, strategy=MegatronStrategy(**case["strategy"]), callbacks=callbacks, **kwargs
    )
    loader = data()
    if "validate" in case:
        trainer.validate(module, dataloaders=loader, ckpt_path=out / f"ckpt_{case['validate']}" / CKPT)
        return
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    torch.save({"state": state, **held}, out / f"{name}_rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:], run_case)
