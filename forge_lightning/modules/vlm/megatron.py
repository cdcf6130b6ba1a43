"""``VisionLanguageModule`` under ``MegatronStrategy``: the LLM as the LLM family's megatron-core twin, the vision
encoder and projector as they are (the strategy runs them at TP = 1, data-parallel over the decoder's TP group, and
with pipeline parallelism apart from the schedule; see ``strategies/megatron/components.py``).

The plan's :class:`~forge_lightning.contracts.Composition` (SigLIP / LLaVA, Qwen2.5-VL, Qwen3-VL)::

    select(batch, rows)   the samples ``rows`` with their own images and videos (the pixel inputs and grids hold
                          the batch's items in order; each sample's items are those its placeholders count)
    encode(batch)         vision -> projector -> [B, S, H]: each sample's features at its image / video
                          placeholders, zero elsewhere (the same shape on every rank, whatever items its share
                          holds); with DeepStack (Qwen3-VL) [B, 1 + K, S, H]: then the K DeepStack layers' features
    merge(tokens, enc)    the features in place of the placeholder tokens' embeddings; labels as they are
    position_ids(batch)   Qwen-VL: the multimodal RoPE positions [3, B, S] of the batch (get_rope_index; every
                          pipeline stage computes them from the input ids and grids); LLaVA: 0 .. S-1
    layer_residuals       Qwen3-VL: the K DeepStack features [B, S, H], added after the LLM's first K layers

Refused with the reason: any-resolution towers (LLaVA-OneVision), DeepStack layers beyond the first pipeline
stage's decoder layers, DeepStack with the decoder's recompute, and LoRA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from forge_lightning.contracts import Composition, MegatronBuild, take_samples
from forge_lightning.modules.vlm.model import VisionLanguageModel
from forge_lightning.modules.vlm.qwen3_vit import Qwen3VisionConfig
from forge_lightning.modules.vlm.towers import Qwen25VisionTower

if TYPE_CHECKING:
    from forge_lightning.modules.llm.megatron import DecoderTwin
    from forge_lightning.modules.vlm.module import VisionLanguageModule

_PIXELS = {"image": "pixel_values", "video": "pixel_values_videos"}
_PER_ITEM = {"image": ("image_sizes",), "video": ("second_per_grid_ts",)}  # one row per image / video
_GRIDS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")


def composition(model: VisionLanguageModel) -> Composition:
    """The plan's composition of ``model``: the decoder ``llm`` and the functions above (module docstring)."""
    deepstack = bool(deepstack_layers(model))
    return Composition(
        decoder="llm",
        encode=lambda batch: encode(model, batch),
        merge=lambda tokens_BSH, encoded, batch: merge(model, tokens_BSH, encoded, batch),
        select=lambda batch, rows: select(model, batch, rows),
        position_ids=(lambda batch: position_ids(model, batch)) if model.tower.multimodal_rope else None,
        layer_residuals=(lambda encoded, batch: list(encoded[:, 1:].unbind(1))) if deepstack else None,
    )


def deepstack_layers(model: VisionLanguageModel) -> list[int]:
    """The encoder blocks whose DeepStack features the LLM's first layers add (Qwen3-VL), one per layer."""
    vision = model.config.vision
    return list(vision.deepstack_layers) if isinstance(vision, Qwen3VisionConfig) else []


def _slots(model: VisionLanguageModel, input_ids_BS: Tensor, kind: str = "image") -> Tensor:
    return input_ids_BS == getattr(model.config, f"{kind}_token_id")


def _given(batch: dict[str, Tensor], key: str) -> Tensor | None:
    """``batch[key]``, ``None`` when absent or empty (a share of the samples without images)."""
    value = batch.get(key)
    return None if value is None or len(value) == 0 else value


def encode(model: VisionLanguageModel, batch: dict[str, Tensor]) -> Tensor:
    """``[B, S, H]``: the projected features of each sample's images and videos at their placeholders, zero
    elsewhere; with DeepStack ``[B, 1 + K, S, H]``, the K DeepStack layers' features (at the same placeholders) after
    them.

    Raises:
        ValueError: an input the tower does not take, or placeholders that do not match the items' features.
    """
    model._check_inputs(**{k: batch.get(k) for k in (*_PIXELS.values(), *_GRIDS, "image_sizes")})
    input_ids_BS = batch["input_ids"]
    weight = next(model.vision.parameters(), None)
    dtype = torch.float32 if weight is None else weight.dtype
    x_BSH = torch.zeros(
        *input_ids_BS.shape, model.config.llm.hidden_size, dtype=dtype, device=input_ids_BS.device
    )
    layers: list[Tensor] = [torch.zeros_like(x_BSH) for _ in deepstack_layers(model)]
    for kind in model.tower.kinds:
        pixels, grid = _given(batch, _PIXELS[kind]), _given(batch, model.tower.grid_inputs[kind])
        x_BSH, kind_layers = model._insert(x_BSH, input_ids_BS, kind, pixels, grid)
        layers = [a + b for a, b in zip(layers, kind_layers)] if kind_layers else layers
    return torch.stack([x_BSH, *layers], dim=1) if layers else x_BSH


def merge(
    model: VisionLanguageModel, tokens_BSH: Tensor, encoded: Tensor, batch: dict[str, Tensor]
) -> tuple[Tensor, Tensor]:
    """The decoder inputs (the image and video features in place of the placeholder tokens' embeddings) and the
    labels.

    The twin attends causally without a padding mask, which gives the native model's values on every real token
    when the padding is on the right (real tokens never see it; its labels are ignored).

    Raises:
        ValueError: left (or inner) padding in ``attention_mask``.
    """
    mask_BS = batch.get("attention_mask")
    if mask_BS is not None and bool((mask_BS[:, 1:] > mask_BS[:, :-1]).any()):
        raise ValueError(
            "attention_mask has padding before real tokens: under MegatronStrategy a vision-language batch must "
            "be padded on the right (the decoder twin attends causally, without a padding mask); pad on the right"
        )
    features_BSH = encoded[:, 0] if encoded.ndim == 4 else encoded
    input_ids_BS = batch["input_ids"]
    slots_BS = torch.zeros_like(input_ids_BS, dtype=torch.bool)
    for kind in model.tower.kinds:
        slots_BS |= _slots(model, input_ids_BS, kind)
    return torch.where(slots_BS[..., None], features_BSH, tokens_BSH), batch["labels"]


def position_ids(model: VisionLanguageModel, batch: dict[str, Tensor]) -> Tensor:
    """The LLM's positions of the whole batch as the native model takes them: the batch's own ``position_ids``,
    else those of the tower (multimodal RoPE ``[3, B, S]`` from the input ids, the padding and the grids)."""
    if batch.get("position_ids") is not None:
        return batch["position_ids"]
    grids = (batch.get(k) for k in _GRIDS)
    return model.position_ids(batch["input_ids"], batch.get("attention_mask"), *grids)[0]


def select(model: VisionLanguageModel, batch: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    """The samples ``rows`` of ``batch`` (repeats allowed) with their own images and videos: their pixel rows,
    grids and per-item entries.

    Raises:
        ValueError: a sample whose placeholders are not a whole number of its items' tokens.
    """
    per_item = {key for kind in model.tower.kinds for key in (_PIXELS[kind], *_item_keys(model, kind))}
    rest = take_samples({k: v for k, v in batch.items() if k not in per_item}, rows)
    for kind in model.tower.kinds:
        if batch.get(_PIXELS[kind]) is None:
            continue
        first_B, count_B = _items_of_samples(model, batch, kind)
        items = [torch.arange(int(first_B[r]), int(first_B[r] + count_B[r])) for r in rows.tolist()]
        index = torch.cat(items) if items else torch.zeros(0, dtype=torch.long)
        for key, rows_I in _item_rows(model, batch, kind).items():
            value = batch[key]
            starts_I = rows_I.cumsum(0) - rows_I
            taken = [torch.arange(int(starts_I[i]), int(starts_I[i] + rows_I[i])) for i in index.tolist()]
            taken_rows = torch.cat(taken) if taken else torch.zeros(0, dtype=torch.long)
            if isinstance(value, Tensor):
                rest[key] = value.index_select(0, taken_rows.to(value.device))
            else:  # a list of per-item numbers (second_per_grid_ts)
                rest[key] = [value[i] for i in taken_rows.tolist()]
    return rest


def _item_keys(model: VisionLanguageModel, kind: str) -> tuple[str, ...]:
    """The batch keys beside the pixels laid out per item of ``kind`` (grids, sizes, video timing)."""
    grid = model.tower.grid_inputs.get(kind)
    return tuple(k for k in (grid, *_PER_ITEM[kind]) if k is not None)


def _item_rows(model: VisionLanguageModel, batch: dict[str, Tensor], kind: str) -> dict[str, Tensor]:
    """``{key: rows of each item [num_items]}`` of the batch's tensors laid out per item of ``kind``."""
    pixels = batch[_PIXELS[kind]]
    if model.tower.fixed_image_tokens:  # one [3, H, W] image per item (else Qwen-VL's patch grids)
        ones_I = torch.ones(len(pixels), dtype=torch.long)
        return {k: ones_I for k in (_PIXELS[kind], *_item_keys(model, kind)) if batch.get(k) is not None}
    grid_I3 = _grid(model, batch, kind)
    ones_I = torch.ones(len(grid_I3), dtype=torch.long)
    rows = {_PIXELS[kind]: grid_I3.prod(-1)}  # one row per patch
    return rows | {k: ones_I for k in _item_keys(model, kind) if batch.get(k) is not None}


def _items_of_samples(
    model: VisionLanguageModel, batch: dict[str, Tensor], kind: str
) -> tuple[Tensor, Tensor]:
    """``(first item, number of items)`` ``[B]`` of each sample: the items of ``kind`` in batch order, each sample
    taking as many as its placeholders count tokens of."""
    slots_B = _slots(model, batch["input_ids"], kind).sum(dim=1).cpu()
    name = model.tower.placeholder(kind)
    if model.tower.fixed_image_tokens:
        per_item = model.config.vision.tokens_per_image
        if bool((slots_B % per_item).any()):
            bad = int(torch.nonzero(slots_B % per_item)[0])
            raise ValueError(
                f"sample {bad} of the micro-batch holds {int(slots_B[bad])} image placeholders, not a multiple of "
                f"vision.tokens_per_image ({per_item}): each image needs all of its placeholder tokens"
            )
        count_B = slots_B // per_item
        return count_B.cumsum(0) - count_B, count_B
    tokens_I = _grid(model, batch, kind).prod(-1) // model.config.vision.spatial_merge_size**2
    ends_I, ends_B = tokens_I.cumsum(0), slots_B.cumsum(0)
    done_B = torch.searchsorted(ends_I, ends_B, right=True)  # the items that end within samples 0 .. b
    reached_B = torch.cat([ends_I.new_zeros(1), ends_I])[done_B]  # where the last of them ends
    if not torch.equal(reached_B, ends_B):
        bad = int(torch.nonzero(reached_B != ends_B)[0])
        raise ValueError(
            f"sample {bad} of the micro-batch does not hold whole {kind}s: the samples hold {slots_B.tolist()} {name} "
            f"tokens, which must each be a whole number of their {kind}s' merged tokens, taken in order "
            f"({kind}_grid_thw t * h * w / spatial_merge_size ** 2: {tokens_I.tolist()})"
        )
    count_B = done_B.diff(prepend=done_B.new_zeros(1))
    return done_B - count_B, count_B


def _grid(model: VisionLanguageModel, batch: dict[str, Tensor], kind: str) -> Tensor:
    key = model.tower.grid_inputs[kind]
    if batch.get(key) is None:
        raise ValueError(f"{kind} pixels ({_PIXELS[kind]}) need their {key}")
    return batch[key].cpu()


def megatron_twin(module: VisionLanguageModule, build: MegatronBuild) -> DecoderTwin:
    """The LLM's megatron-core twin for ``MegatronStrategy``, with the module's loss and bookkeeping.

    Raises:
        NotImplementedError: an any-resolution tower, DeepStack layers the first pipeline stage does not hold or
            with the decoder's recompute, or LoRA.
        ValueError: a per-component setting the strategy would not apply (``lr``, ``activation_checkpointing``,
            ``compile``), with the option to use instead.
    """
    from forge_lightning.modules.llm.loss import LMLoss
    from forge_lightning.modules.llm.megatron import DecoderTwin

    check_supported(module, build)
    loss = LMLoss(ignore_index=module.ignore_index, z_loss=module.z_loss)
    return DecoderTwin(module.model.llm, build, loss=loss, objective=module.objective, log=module.log)


def check_supported(module: VisionLanguageModule, build: MegatronBuild | None = None) -> None:
    """Raise for what the megatron path of a vision-language model does not run (see :func:`megatron_twin`);
    ``build``: also what its layout does not run."""
    config = module.config
    if build is not None:
        _check_deepstack(module, build)
    tower = module.model.tower
    if not tower.fixed_image_tokens and not isinstance(tower, Qwen25VisionTower):
        raise NotImplementedError(
            f"vision.type {config.vision_type!r} is not yet supported by MegatronStrategy: its images give different "
            "numbers of tokens (any-resolution tiles), and the encoder's share of a micro-batch is cut by a fixed "
            "number of tokens per image or by Qwen-VL's patch grids (image_grid_thw); train it with FSDP2Strategy "
            "or DDPStrategy"
        )
    for name, settings in module.components.items():
        if settings.lora is not None:
            raise NotImplementedError(
                f"components.{name}.lora: LoRA is not yet supported by MegatronStrategy; train LoRA adapters "
                "with FSDP2Strategy or DDPStrategy"
            )
        refused: dict[str, Any] = {
            "lr": (settings.lr, "megatron's optimizer steps every component at optimizer.lr"),
            "activation_checkpointing": (
                settings.activation_checkpointing,
                f"set the strategy's components.{name}.recompute instead",
            ),
            "compile": (settings.compile, "nothing is compiled under MegatronStrategy"),
        }
        for option, (value, why) in refused.items():
            if value not in (None, False, "none"):
                raise ValueError(
                    f"components.{name}.{option} ({value!r}) is not applied under MegatronStrategy: {why}; "
                    "leave it unset"
                )


def _check_deepstack(module: VisionLanguageModule, build: MegatronBuild) -> None:
    """DeepStack features come from the encoder side, which only the first pipeline stage holds (and the twin's
    recomputed layers would not add them)."""
    layers = deepstack_layers(module.model)
    if not layers:
        return
    dims = build.dims
    first_chunk = module.config.llm.num_layers // (dims.pp * dims.vpp)
    if len(layers) > first_chunk:
        raise NotImplementedError(
            f"vision.deepstack_layers ({layers}) feed the LLM's first {len(layers)} decoder layers, but the first "
            f"pipeline chunk holds {first_chunk} (num_layers {module.config.llm.num_layers} / pipeline "
            f"{dims.pp} x virtual {dims.vpp}): DeepStack features reach only the first pipeline stage (which holds the "
            "encoder side) under MegatronStrategy; use a pipeline layout whose first chunk holds at least "
            f"{len(layers)} layers"
        )
    recompute = build.recompute == "full" or (
        build.performance is not None and build.performance.activation_checkpointing == "full"
    )
    if recompute:
        raise NotImplementedError(
            "the decoder's recompute ('full') with DeepStack (vision.deepstack_layers) is not yet supported by "
            "MegatronStrategy: megatron's recomputed layers would not add the DeepStack features; recompute the "
            "vision component only (components.vision.recompute) or leave the decoder's recompute 'none'"
        )
