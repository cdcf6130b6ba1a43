"""Micro-batch rules of the interleaved (VPP) schedule; its losses are checked in test_checkpoint.py."""

import pytest
import torch
from moe_reference import decoder_twin

from forge_lightning.modules.llm.config import LLMConfig
from forge_lightning.modules.llm.model import DecoderLM
from forge_lightning.strategies.megatron.schedule import check_interleaved_micro_batches, eval_micro_batches


def test_accumulation_must_be_a_multiple_of_the_pipeline_size_with_vpp():
    check_interleaved_micro_batches(2, 2, 4)
    check_interleaved_micro_batches(2, None, 3)  # plain 1F1B takes any count
    with pytest.raises(
        ValueError, match=r"accumulate_grad_batches \(3\) must be a multiple of 2 \(e\.g\. 2 or 4"
    ):
        check_interleaved_micro_batches(2, 2, 3)


def _batch(size: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(size * 6).reshape(size, 6)
    labels = ids.clone()
    labels[:, :2] = -100
    return {"input_ids": ids, "labels": labels}


def _tokens(batches: list[dict[str, torch.Tensor]]) -> tuple[int, list[int]]:
    return sum(int((b["labels"] != -100).sum()) for b in batches), sorted(
        int(t) for b in batches for t in b["labels"][b["labels"] != -100]
    )


@pytest.mark.parametrize(("size", "count"), [(4, 2), (3, 2), (1, 4), (2, 1)])
def test_eval_micro_batches_keep_exactly_the_trainable_tokens(size, count):
    batch = _batch(size)

    with torch.device("meta"):  # the decoder twin's padding (every label ignored): no weights needed
        twin = decoder_twin(DecoderLM(LLMConfig.from_preset("debug")))
    parts = eval_micro_batches(batch, count, twin=twin)
    assert len(parts) == count
    assert _tokens(parts) == _tokens([batch])
    if size % count == 0:  # split, not padded
        assert torch.equal(torch.cat([p["input_ids"] for p in parts]), batch["input_ids"])
