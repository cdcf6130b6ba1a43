"""Shared HF parity checks of the Qwen-VL families (Qwen2.5-VL, Qwen3-VL) on tiny random checkpoints (fp32): batches
of placeholder runs and random patches, logits within 1e-4 (max abs), the loss within 1e-5 (relative), every
parameter's gradient within 1e-4 (relative L2), and exports that transformers loads with the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from llm_parity import randomize_weights

from forge_lightning.modules.vlm import from_pretrained, save_pretrained

VOCAB = 256
IMAGE, VIDEO, START, END = 250, 251, 252, 253
LOGITS_TOL, LOSS_TOL, GRAD_TOL = 1e-4, 1e-5, 1e-4

Grid = tuple[int, int, int]


def hf_checkpoint(
    hf_cls,
    config_cls,
    text_config: dict,
    vision_config: dict,
    path: Path,
    tie: bool = False,
    tokens: dict[str, int] | None = None,
):
    """A random fp32 ``hf_cls`` (weights ~ N(0, 0.1)) with our special tokens (or ``tokens``: ``image_token_id``
    ... by config name), saved to ``path``."""
    tokens = tokens or dict(
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END
    )
    config = config_cls(
        text_config=text_config, vision_config=vision_config, tie_word_embeddings=tie, **tokens
    )
    torch.manual_seed(0)
    hf = hf_cls(config).float().eval()
    randomize_weights(hf, weight_std=0.1)
    hf.save_pretrained(path)
    return hf


def text(n: int, seed: int) -> list[int]:
    """``n`` random text tokens below the special ones."""
    return torch.randint(3, 240, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def placeholders(token: int, grid: Grid) -> list[int]:
    """An item as the processor writes it: one pad token per merged patch (merge 2) between start and end."""
    return [START] + [token] * (grid[0] * grid[1] * grid[2] // 4) + [END]


def pixels(grids: list[Grid], seed: int, patch: int) -> torch.Tensor:
    """Random ``[num_patches, 3 * 2 * patch ** 2]`` patch rows for ``grids``."""
    num_patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(num_patches, 3 * 2 * patch**2, generator=torch.Generator().manual_seed(seed))


def hf_video_rows(frames: list, hf_processor, temporal_patch_size: int = 2) -> tuple[torch.Tensor, list[int]]:
    """The patch rows and grid of a video's ``frames`` as transformers makes them: its PIL image processor
    ``hf_processor`` (at the video pixel limits) on each frame, in ``Qwen2VLVideoProcessor.patchify``'s layout
    (temporal patches outermost, each row ``[C, temporal, P, P]``, an odd count padded with the last frame)."""
    P, S = hf_processor.patch_size, temporal_patch_size
    per_frame, grid = [], None
    for frame in frames:
        out = hf_processor(images=[frame], return_tensors="pt")
        rows = out["pixel_values"]
        per_frame.append(rows.reshape(len(rows), 3, S, P, P)[:, :, 0])
        grid = out["image_grid_thw"][0, 1:].tolist()
    per_frame += per_frame[-1:] * (-len(frames) % S)
    groups = [torch.stack(per_frame[t : t + S], dim=2) for t in range(0, len(per_frame), S)]
    return torch.cat([g.reshape(len(g), -1) for g in groups]), [len(groups), *grid]


def right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of ``rows`` padded on the right with token 0."""
    seq = max(map(len, rows))
    ids, mask = torch.zeros(len(rows), seq, dtype=torch.long), torch.zeros(len(rows), seq, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)], mask[b, : len(row)] = torch.tensor(row), 1
    return ids, mask


def hf_logits(
    hf, batch: dict, *, image: int = IMAGE, video: int = VIDEO, **kwargs
) -> tuple[torch.Tensor, object]:
    """transformers' logits and output for ``batch`` (with the processor's ``mm_token_type_ids``; ``image`` /
    ``video``: the placeholder ids)."""
    ids = batch["input_ids"]
    token_types = (ids == image).int() + 2 * (ids == video).int()
    out = hf(**batch, mm_token_type_ids=token_types, **kwargs)
    return out.logits, out


def labels(batch: dict, *, image: int = IMAGE, video: int = VIDEO) -> torch.Tensor:
    """The input ids as labels, -100 at padding and placeholders."""
    ids = batch["input_ids"]
    ignore = (batch["attention_mask"] == 0) | (ids == image) | (ids == video)
    return ids.masked_fill(ignore, -100)


def hf_name(name: str) -> str:
    """transformers 5's in-memory name of our parameter ``name``."""
    if name.startswith("vision."):
        return "model.visual." + name.removeprefix("vision.")
    if name.startswith("llm.model."):
        return "model.language_model." + name.removeprefix("llm.model.")
    return name.removeprefix("llm.")


def assert_matches_transformers(
    hf, model, batch: dict, *, image: int = IMAGE, video: int = VIDEO, router_aux: bool = False
) -> dict[str, float]:
    """Logits (at the kept tokens), loss and every gradient of ``model`` against ``hf`` on ``batch`` (``image`` /
    ``video``: the placeholder ids); with ``router_aux`` (MoE LLMs) the loss includes the load-balancing loss over
    the unpadded tokens, weighted by ``router_aux_loss_coef``, and that loss is compared too. Returns the errors."""
    hf.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    target = labels(batch, image=image, video=video)
    keep = batch["attention_mask"].bool()

    logits = model(**batch)
    extra = {"output_router_logits": True} if router_aux else {}
    want_logits, out = hf_logits(hf, batch, image=image, video=video, labels=target, **extra)
    errors = {"logits": (logits - want_logits)[keep].abs().max().item()}
    assert errors["logits"] <= LOGITS_TOL, errors

    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), target[:, 1:].flatten(), ignore_index=-100)
    if router_aux:
        aux = model.llm.router_losses(batch["attention_mask"]).aux_loss
        errors["aux_loss"] = abs(aux.item() - out.aux_loss.item()) / out.aux_loss.item()
        assert errors["aux_loss"] <= LOSS_TOL, errors
        loss = loss + model.config.llm.moe.aux_loss_coef * aux
    errors["loss"] = abs(loss.item() - out.loss.item()) / out.loss.item()
    assert errors["loss"] <= LOSS_TOL, errors

    loss.backward()
    out.loss.backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    assert {hf_name(name) for name, _ in model.named_parameters()} == hf_grads.keys()
    errors["grad"] = 0.0
    for name, p in model.named_parameters():
        want = hf_grads[hf_name(name)]
        rel = ((p.grad - want).norm() / want.norm()).item()
        assert rel <= GRAD_TOL, f"{name}: relative gradient error {rel:.2e}"
        errors["grad"] = max(errors["grad"], rel)
    return errors


def assert_export_loads(model, hf_cls, batch: dict, out_dir: Path) -> Path:
    """Save ``model`` in shards; ``hf_cls`` loads it with the same logits, and so do we, tensor for tensor."""
    out = save_pretrained(model, model.config, out_dir, max_shard_size="100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert {k.split(".")[0] + "." + k.split(".")[1] for k in index["weight_map"]} == {
        "model.visual",
        "model.language_model",
        "lm_head.weight",
    }
    assert (out / "generation_config.json").is_file()
    hf = hf_cls.from_pretrained(out).eval()
    with torch.no_grad():
        assert (model(**batch) - hf_logits(hf, batch)[0]).abs().max().item() <= LOGITS_TOL
    again = from_pretrained(out)
    for (name, p), q in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(p, q), name
    return out


def assert_tied_round_trip(hf, hf_cls, path: Path, batch: dict, out_dir: Path) -> None:
    """The tied checkpoint at ``path`` (of ``hf``) loads tied with ``hf``'s logits, and so does our export."""
    model = from_pretrained(path)
    assert model.config.llm.tie_word_embeddings
    assert model.llm.lm_head.weight is model.llm.model.embed_tokens.weight
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        assert (model(**batch) - hf_logits(hf, batch)[0])[keep].abs().max().item() <= LOGITS_TOL
        back = hf_cls.from_pretrained(save_pretrained(model, model.config, out_dir)).eval()
        assert (model(**batch) - hf_logits(back, batch)[0])[keep].abs().max().item() <= LOGITS_TOL
