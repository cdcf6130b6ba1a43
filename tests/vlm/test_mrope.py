"""Multimodal RoPE against transformers' Qwen2.5-VL / Qwen3-VL: the 3-D position ids (``get_rope_index``) exactly,
and the language model fed with them (hidden states and gradients, fp32, within 1e-5)."""

from __future__ import annotations

import pytest
import torch
from llm_parity import randomize_weights
from tiny import TINY_QWEN2_5_VL_TEXT, TINY_QWEN3_VL_TEXT
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen3VLConfig, Qwen3VLModel
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

from forge_lightning.modules.layers import MultimodalRotaryEmbedding, RotaryEmbedding, rope_inv_freq
from forge_lightning.modules.llm import DecoderLM, LLMConfig
from forge_lightning.modules.vlm.positions import get_rope_index

IMAGE, VIDEO, START, END = (
    151655,
    151656,
    151652,
    151653,
)  # <|image_pad|>, <|video_pad|>, <|vision_start|>, <|vision_end|>
VOCAB = 151936
MERGE = 2
TOKENS_PER_SECOND = 2
TOL = 1e-5  # max abs error of hidden states; relative L2 error of each gradient

QWEN2_5_TEXT = dict(vocab_size=VOCAB, **TINY_QWEN2_5_VL_TEXT)
QWEN3_TEXT = dict(vocab_size=VOCAB, **TINY_QWEN3_VL_TEXT)
VISION = dict(depth=1, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=32)


@pytest.fixture(scope="module")
def hf_qwen2_5() -> Qwen2_5_VLModel:
    vision = {
        **VISION,
        "tokens_per_second": TOKENS_PER_SECOND,
        "spatial_merge_size": MERGE,
        "fullatt_block_indexes": [0],
    }
    config = Qwen2_5_VLConfig(
        text_config=QWEN2_5_TEXT, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO
    )
    return Qwen2_5_VLModel(config).eval()


@pytest.fixture(scope="module")
def hf_qwen3() -> Qwen3VLModel:
    vision = {
        **VISION,
        "spatial_merge_size": MERGE,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [],
    }
    config = Qwen3VLConfig(
        text_config=QWEN3_TEXT, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO
    )
    return Qwen3VLModel(config).eval()


def _text(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _vision(token: int, grid: tuple[int, int, int]) -> list[int]:
    return [START] + [token] * (grid[0] * grid[1] * grid[2] // MERGE**2) + [END]


def _batch(rows: list[list[int]], *, left_pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` padded with token 0 to the longest row."""
    seq = max(map(len, rows))
    ids = torch.zeros(len(rows), seq, dtype=torch.long)
    mask = torch.zeros(len(rows), seq, dtype=torch.long)
    for b, row in enumerate(rows):
        where = slice(seq - len(row), seq) if left_pad else slice(0, len(row))
        ids[b, where], mask[b, where] = torch.tensor(row), 1
    return ids, mask


def _token_types(input_ids: torch.Tensor) -> torch.Tensor:
    return (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()


IMG_A, IMG_B, VID = (1, 4, 6), (1, 6, 2), (3, 4, 4)
CASES = {
    "two_images": (
        [_text(3, 0) + _vision(IMAGE, IMG_A) + _text(4, 1) + _vision(IMAGE, IMG_B) + _text(2, 2)],
        False,
    ),
    "video": ([_text(2, 3) + _vision(VIDEO, VID) + _text(5, 4)], False),
    "image_and_text_only": ([_text(2, 5) + _vision(IMAGE, IMG_A) + _text(3, 6), _text(9, 7)], False),
    "left_padding": (
        [_text(2, 8) + _vision(IMAGE, IMG_B) + _text(1, 9), _text(4, 10), _vision(VIDEO, VID)],
        True,
    ),
}


def _grids(input_ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The image / video grids of a CASES batch, in the order their runs appear."""
    images, videos = [], []
    for row in input_ids.tolist():
        i = 0
        while i < len(row):
            if row[i] in (IMAGE, VIDEO):
                run = next(j for j in range(i, len(row) + 1) if j == len(row) or row[j] != row[i])
                pick = videos if row[i] == VIDEO else images
                n = run - i
                pick.append(VID if row[i] == VIDEO else (IMG_A if n == 6 else IMG_B))
                i = run
            else:
                i += 1
    as_tensor = lambda g: torch.tensor(g) if g else None  # noqa: E731
    return as_tensor(images), as_tensor(videos)


@pytest.mark.parametrize("case", sorted(CASES))
def test_rope_index_matches_qwen2_5_vl(hf_qwen2_5: Qwen2_5_VLModel, case: str) -> None:
    rows, left_pad = CASES[case]
    input_ids, mask = _batch(rows, left_pad=left_pad)
    images, videos = _grids(input_ids)
    seconds = torch.tensor([0.75] * len(videos)) if videos is not None else None
    kwargs = dict(
        image_grid_thw=images, video_grid_thw=videos, second_per_grid_ts=seconds, attention_mask=mask
    )
    want_pos, want_deltas = hf_qwen2_5.get_rope_index(input_ids, _token_types(input_ids), **kwargs)
    pos, deltas = get_rope_index(
        input_ids,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        spatial_merge_size=MERGE,
        tokens_per_second=TOKENS_PER_SECOND,
        **kwargs,
    )
    assert torch.equal(pos, want_pos) and torch.equal(deltas, want_deltas)


@pytest.mark.parametrize("case", sorted(CASES))
def test_rope_index_matches_qwen3_vl(hf_qwen3: Qwen3VLModel, case: str) -> None:
    rows, left_pad = CASES[case]
    # Qwen3-VL separates the frames of a video with timestamp text: one placeholder run per frame.
    frame = [VIDEO] * (VID[1] * VID[2] // MERGE**2)
    timed_video = [START] + sum(([7, 8] + frame for _ in range(VID[0])), []) + [END]
    rows = [_split(row, timed_video) if VIDEO in row else row for row in rows]
    input_ids, mask = _batch(rows, left_pad=left_pad)
    images, _ = _grids(input_ids)
    videos = torch.tensor([VID] * sum(VIDEO in r for r in rows)) if any(VIDEO in r for r in rows) else None
    kwargs = dict(image_grid_thw=images, video_grid_thw=videos, attention_mask=mask)
    want_pos, want_deltas = hf_qwen3.get_rope_index(input_ids, _token_types(input_ids), **kwargs)
    kwargs["video_grid_thw"] = None if videos is None else videos.clone()  # HF edits the tensor in place
    pos, deltas = get_rope_index(
        input_ids,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        spatial_merge_size=MERGE,
        split_video_frames=True,
        **kwargs,
    )
    assert torch.equal(pos, want_pos) and torch.equal(deltas, want_deltas)


def _split(row: list[int], timed_video: list[int]) -> list[int]:
    """``row`` with its one Qwen2.5-VL-style video item replaced by ``timed_video``."""
    first, last = row.index(VIDEO) - 1, len(row) - row[::-1].index(VIDEO) + 1
    return row[:first] + timed_video + row[last:]


def test_text_only_rows_get_1d_positions_and_padding_zero() -> None:
    input_ids, mask = _batch([_text(5, 0), _text(3, 1)], left_pad=True)
    pos, deltas = get_rope_index(
        input_ids, image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=MERGE, attention_mask=mask
    )
    assert pos[:, 1].tolist() == [[0, 0, 0, 1, 2]] * 3
    assert torch.equal(pos[:, 0], torch.arange(5).expand(3, -1)) and deltas.tolist() == [[0], [0]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            dict(image_grid_thw=torch.tensor([[1, 4, 8]])),
            r"image_grid_thw\[0\] \(\[1, 4, 8\], merge 2\) needs 8",
        ),
        (
            dict(image_grid_thw=torch.tensor([IMG_A, IMG_A])),
            r"image_grid_thw has 2 rows but input_ids hold 1",
        ),
        (dict(), r"more placeholder runs than image_grid_thw has rows \(0\)"),
        (
            dict(
                image_grid_thw=torch.tensor([IMG_A]),
                video_grid_thw=torch.tensor([VID]),
                tokens_per_second=2,
                split_video_frames=True,
            ),
            r"leave them unset",
        ),
    ],
)
def test_rope_index_refuses_mismatched_grids(kwargs: dict, match: str) -> None:
    input_ids, _ = _batch([_text(2, 0) + _vision(IMAGE, IMG_A)])
    with pytest.raises(ValueError, match=match):
        get_rope_index(
            input_ids, image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=MERGE, **kwargs
        )


# ------------------------------------------------------------------------------------------- language model


def _load(hf_text: torch.nn.Module) -> DecoderLM:
    """Our decoder with the HF text model's weights (its parameters lack the ``model.`` prefix and the head)."""
    model = DecoderLM(LLMConfig.from_hf(hf_text.config.to_dict()))
    state = {f"model.{k}": v for k, v in hf_text.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected
    return model


def _parity(
    hf_text: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor
) -> tuple[float, float]:
    """Max abs hidden-state error and max relative gradient error of our decoder against ``hf_text``."""
    model = _load(hf_text)
    hidden = model.hidden_states(input_ids, position_ids)
    want = hf_text(input_ids=input_ids, position_ids=position_ids).last_hidden_state
    probe = torch.randn(want.shape, generator=torch.Generator().manual_seed(0))
    (hidden * probe).sum().backward()
    (want * probe).sum().backward()
    grads = {f"model.{k}": p.grad for k, p in hf_text.named_parameters()}
    grad_err = max(
        ((p.grad - grads[name]).norm() / grads[name].norm()).item()
        for name, p in model.named_parameters()
        if name != "lm_head.weight"
    )
    return (hidden - want).abs().max().item(), grad_err


def _mm_batch() -> tuple[torch.Tensor, torch.Tensor]:
    input_ids, _ = _batch(
        [
            _text(3, 0) + _vision(IMAGE, IMG_A) + _text(4, 1) + _vision(IMAGE, IMG_B) + _text(2, 2),
            _text(2, 3) + _vision(IMAGE, (1, 8, 8)) + _text(4, 4),
        ]
    )
    images = torch.tensor([IMG_A, IMG_B, (1, 8, 8)])
    pos, _ = get_rope_index(
        input_ids, image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=MERGE, image_grid_thw=images
    )
    assert not torch.equal(pos[0], pos[1])  # the axes differ: M-RoPE is exercised
    return input_ids, pos


@pytest.mark.parametrize(
    ("text_cls", "hf_config"), [(Qwen2_5_VLTextModel, "qwen2_5"), (Qwen3VLTextModel, "qwen3")]
)
def test_language_model_matches_transformers(text_cls: type, hf_config: str) -> None:
    torch.manual_seed(0)
    config_cls = Qwen2_5_VLConfig if hf_config == "qwen2_5" else Qwen3VLConfig
    text = QWEN2_5_TEXT if hf_config == "qwen2_5" else QWEN3_TEXT
    hf_text = text_cls(config_cls(text_config=text).text_config).float()
    randomize_weights(hf_text, weight_std=0.1)
    input_ids, pos = _mm_batch()
    hidden_err, grad_err = _parity(hf_text, input_ids, pos)
    assert hidden_err <= TOL and grad_err <= TOL, (hidden_err, grad_err)


def test_1d_positions_equal_plain_rope() -> None:
    mrope = MultimodalRotaryEmbedding(16, [4, 2, 2], interleaved=True)
    positions = torch.arange(7)[None]
    for got, want in zip(mrope(positions), RotaryEmbedding(16)(positions)):
        assert torch.equal(got, want)
    for got, want in zip(mrope(positions.expand(3, 1, -1)), RotaryEmbedding(16)(positions)):
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------- config and errors


@pytest.mark.parametrize(("arch", "text"), [("qwen2_5_vl_text", QWEN2_5_TEXT), ("qwen3_vl_text", QWEN3_TEXT)])
def test_config_round_trip(arch: str, text: dict) -> None:
    config_cls = Qwen2_5_VLConfig if arch == "qwen2_5_vl_text" else Qwen3VLConfig
    hf = config_cls(text_config=text).text_config
    config = LLMConfig.from_hf(hf.to_dict())
    assert config.architecture == arch and config.mrope_section == text["rope_parameters"]["mrope_section"]
    assert config.mrope_interleaved == (arch == "qwen3_vl_text")
    back = type(hf)(**config.to_hf())
    assert back.rope_parameters == hf.rope_parameters
    assert LLMConfig.from_hf(config.to_hf()) == config


def test_legacy_mrope_rope_scaling() -> None:
    hf = Qwen2_5_VLConfig(text_config=QWEN2_5_TEXT).text_config.to_dict()
    hf.pop("rope_parameters")
    hf["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
    assert LLMConfig.from_hf(hf).rope_scaling == {"rope_type": "default", "mrope_section": [2, 3, 3]}


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            dict(rope_scaling={"rope_type": "default", "mrope_section": [2, 2, 2]}),
            r"mrope_section \(\[2, 2, 2\]\) must sum to head_dim // 2 \(8\)",
        ),
        (
            dict(rope_scaling={"mrope_section": [8, 0]}),
            r"mrope_section \(\[8, 0\]\) must be a list of positive integers",
        ),
        (
            dict(rope_scaling={"mrope_interleaved": True}),
            r"mrope_interleaved \(True\) needs an mrope_section",
        ),
        (
            dict(architecture="qwen3_vl_text", qk_norm=True, rope_scaling={"mrope_section": [4, 2, 2]}),
            r"mrope_interleaved \(False\) must be True for architecture 'qwen3_vl_text'",
        ),
    ],
)
def test_config_refuses_bad_mrope(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLMConfig.from_preset("debug", **overrides)


def test_3d_positions_need_mrope() -> None:
    model = DecoderLM(LLMConfig.from_preset("debug"))
    input_ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"position_ids of shape \[3, 1, 4\] are multimodal RoPE positions"):
        model(input_ids, torch.zeros(3, 1, 4, dtype=torch.long))
    mrope = DecoderLM(LLMConfig.from_preset("debug", rope_scaling={"mrope_section": [4, 2, 2]}))
    with pytest.raises(ValueError, match=r"must be \[3, B, S\]"):
        mrope(input_ids, torch.zeros(2, 1, 4, dtype=torch.long))
    assert torch.equal(mrope(input_ids), mrope(input_ids, torch.arange(4).expand(3, 1, -1)))


def test_mrope_model_builds_on_meta_and_scales_frequencies() -> None:
    mrope = {"mrope_section": [4, 2, 2], "mrope_interleaved": True}
    config = LLMConfig.from_preset("debug", rope_scaling={"rope_type": "linear", "factor": 2.0, **mrope})
    with torch.device("meta"):
        model = DecoderLM(config)
    model.to_empty(device="cpu")
    model.init_weights()
    rotary = model.model.rotary_emb
    assert rotary.axis_of_freq.tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    assert torch.equal(rotary.inv_freq, rope_inv_freq(16, 10000.0, {"rope_type": "linear", "factor": 2.0}))
    assert LLMConfig.from_hf(config.to_hf()).rope_scaling == {"rope_type": "linear", "factor": 2.0, **mrope}


def test_1d_frequencies_refuse_mrope_keys() -> None:
    with pytest.raises(ValueError, match="build MultimodalRotaryEmbedding"):
        rope_inv_freq(16, 10000.0, {"rope_type": "default", "mrope_section": [4, 2, 2]})
    with pytest.raises(ValueError, match=r"mrope_section \(\[4, 4, 4\]\) must be positive counts summing to"):
        MultimodalRotaryEmbedding(16, [4, 4, 4])
    with pytest.raises(
        ValueError, match=r"cannot be interleaved over 8 frequencies: the layout gives the axes"
    ):
        MultimodalRotaryEmbedding(16, [2, 5, 1], interleaved=True)
