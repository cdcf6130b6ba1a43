"""``VisionLanguageModule`` under ``MegatronStrategy``: the LLM as the LLM family's megatron-core twin, the vision
encoder and projector as they are (the strategy runs them at TP = 1, data-parallel over the decoder's TP group, and
with pipeline parallelism apart from the schedule; see ``strategies/megatron/components.py``).

The plan's :class:`~forge_lightning.contracts.Composition` for towers with a fixed number of features per image
(SigLIP, LLaVA's ``<image>`` placeholders) and 1-D positions::

    select(batch, rows)   the samples ``rows`` with their own images (pixel_values holds the batch's images in
                          order; each sample's count is its placeholders / tokens_per_image)
    encode(batch)         vision -> projector -> [B, S, H]: each sample's features at its placeholder positions,
                          zero elsewhere (the same shape on every rank, whatever images its share holds)
    merge(tokens, enc)    the features in place of the placeholder tokens' embeddings; labels as they are

Qwen-VL towers (multimodal RoPE ``[3, B, S]``, DeepStack) and LoRA are refused with the reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from forge_lightning.contracts import Composition, MegatronBuild, take_samples
from forge_lightning.modules.vlm.model import VisionLanguageModel

if TYPE_CHECKING:
    from forge_lightning.modules.llm.megatron import DecoderTwin
    from forge_lightning.modules.vlm.module import VisionLanguageModule

_IMAGE_KEYS = ("pixel_values", "image_sizes")  # laid out per image, not per sample


def composition(model: VisionLanguageModel) -> Composition:
    """The plan's composition of ``model``: the decoder ``llm`` and the functions above (module docstring)."""
    return Composition(
        decoder="llm",
        encode=lambda batch: encode(model, batch),
        merge=lambda tokens_BSH, encoded_BSH, batch: merge(model, tokens_BSH, encoded_BSH, batch),
        select=lambda batch, rows: select(model, batch, rows),
    )


def _slots(model: VisionLanguageModel, input_ids_BS: Tensor) -> Tensor:
    return input_ids_BS == model.config.image_token_id


def encode(model: VisionLanguageModel, batch: dict[str, Tensor]) -> Tensor:
    """``[B, S, H]``: the projected features of each sample's images at its image placeholders, zero elsewhere.

    Raises:
        ValueError: an input the tower does not take, or placeholders that do not match the images' features.
    """
    model._check_inputs(
        **{k: batch.get(k) for k in ("pixel_values", "image_grid_thw", "pixel_values_videos")}
    )
    input_ids_BS = batch["input_ids"]
    slots_BS = _slots(model, input_ids_BS)
    pixels = batch.get("pixel_values")
    width = model.config.llm.hidden_size
    if pixels is None or pixels.shape[0] == 0:
        if slots_BS.any():
            raise ValueError(
                f"input_ids hold {int(slots_BS.sum())} {model.tower.placeholder('image')} tokens but no image "
                "pixels were given (pixel_values)"
            )
        weight = next(model.projector.parameters(), None)
        dtype = torch.float32 if weight is None else weight.dtype
        return torch.zeros(*input_ids_BS.shape, width, dtype=dtype, device=input_ids_BS.device)
    features_ND = model.projector(model.tower.encode(model.vision, pixels, None, "image"))
    if features_ND.shape[0] != int(slots_BS.sum()):
        origin = model.tower.describe_count(model.config, "image", pixels, features_ND.shape[0])
        raise ValueError(
            f"{origin}, so input_ids must hold {features_ND.shape[0]} {model.tower.placeholder('image')} tokens "
            f"(image_token_id), but {int(slots_BS.sum())} were found"
        )
    return features_ND.new_zeros(*input_ids_BS.shape, width).index_put((slots_BS,), features_ND)


def merge(
    model: VisionLanguageModel, tokens_BSH: Tensor, encoded_BSH: Tensor, batch: dict[str, Tensor]
) -> tuple[Tensor, Tensor]:
    """The decoder inputs (the image features in place of the placeholder tokens' embeddings) and the labels.

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
    slots_BS1 = _slots(model, batch["input_ids"])[..., None]
    return torch.where(slots_BS1, encoded_BSH, tokens_BSH), batch["labels"]


def select(model: VisionLanguageModel, batch: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
    """The samples ``rows`` of ``batch`` (repeats allowed) with their own images.

    Raises:
        ValueError: a sample whose placeholders are not a whole number of images.
    """
    rest = take_samples({k: v for k, v in batch.items() if k not in _IMAGE_KEYS}, rows)
    if batch.get("pixel_values") is None:
        return rest
    per_image = model.config.vision.tokens_per_image
    slots_B = _slots(model, batch["input_ids"]).sum(dim=1)
    if bool((slots_B % per_image).any()):
        bad = int(torch.nonzero(slots_B % per_image)[0])
        raise ValueError(
            f"sample {bad} of the micro-batch holds {int(slots_B[bad])} image placeholders, not a multiple of "
            f"vision.tokens_per_image ({per_image}): each image needs all of its placeholder tokens"
        )
    images_B = (slots_B // per_image).cpu()
    first_B = images_B.cumsum(0) - images_B
    taken = [torch.arange(int(first_B[r]), int(first_B[r] + images_B[r])) for r in rows.tolist()]
    index = torch.cat(taken) if taken else torch.zeros(0, dtype=torch.long)
    for key in _IMAGE_KEYS:
        if batch.get(key) is not None:
            rest[key] = batch[key].index_select(0, index.to(batch[key].device))
    return rest


def megatron_twin(module: VisionLanguageModule, build: MegatronBuild) -> DecoderTwin:
    """The LLM's megatron-core twin for ``MegatronStrategy``, with the module's loss and bookkeeping.

    Raises:
        NotImplementedError: a tower with multimodal RoPE (Qwen-VL), or LoRA.
        ValueError: a per-component setting the strategy would not apply (``lr``, ``activation_checkpointing``,
            ``compile``), with the option to use instead.
    """
    from forge_lightning.modules.llm.loss import LMLoss
    from forge_lightning.modules.llm.megatron import DecoderTwin

    check_supported(module)
    loss = LMLoss(ignore_index=module.ignore_index, z_loss=module.z_loss)
    return DecoderTwin(module.model.llm, build, loss=loss, objective=module.objective, log=module.log)


def check_supported(module: VisionLanguageModule) -> None:
    """Raise for what the megatron path of a vision-language model does not run (see :func:`megatron_twin`)."""
    config = module.config
    if module.model.tower.multimodal_rope:
        raise NotImplementedError(
            f"vision.type {config.vision_type!r} is not yet supported by MegatronStrategy: its LLM rotates by "
            "multimodal RoPE positions [3, B, S] (and Qwen3-VL adds DeepStack features inside the decoder), which "
            "the megatron-core GPT twin does not take; train it with FSDP2Strategy or DDPStrategy, or use a tower "
            "with 1-D positions (siglip)"
        )
    if not module.model.tower.fixed_image_tokens:
        raise NotImplementedError(
            f"vision.type {config.vision_type!r} is not yet supported by MegatronStrategy: its images give different "
            "numbers of tokens (any-resolution tiles), and the encoder's share of a micro-batch is cut by a fixed "
            "number of tokens per image; train it with FSDP2Strategy or DDPStrategy"
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
