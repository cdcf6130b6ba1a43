"""The tiny HF configs that CPU tests share: a Llama-style LLM (same as tests/configs/tiny_llm.yaml) and the
Qwen2.5-VL / Qwen3-VL text models."""

TINY_LLM = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}

# The text model of the tiny Qwen2.5-VL (no vocabulary: each test sets its own); head_dim 16, M-RoPE [2, 3, 3].
TINY_QWEN2_5_VL_TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)

# The text model of the tiny Qwen3-VL (no vocabulary): head_dim 32, interleaved M-RoPE [6, 5, 5], QK norm.
TINY_QWEN3_VL_TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    },
)

# Image tokens of Qwen2-VL / Qwen2.5-VL and of fixed-resolution (LLaVA / SigLIP) models.
VLM_SPECIAL_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<image>")
_VLM_WORDS = (
    "what colour is the triangle square circle in the picture? it is red green blue yellow. describe the image: "
    "a small shape on a white background. how many shapes are there? two, three. thanks, goodbye. "
)


def write_vlm_tokenizer(directory, *, image_tokens=VLM_SPECIAL_TOKENS, template="chatml"):
    """A small byte-level BPE chat tokenizer in ``directory`` with a built-in chat template and ``image_tokens`` as
    special tokens; returns the directory."""
    from forge_lightning.datamodules.chat import add_chat_template
    from forge_lightning.datamodules.tokenizer import add_special_tokens, train_bpe_tokenizer

    train_bpe_tokenizer([_VLM_WORDS * 4] * 8, 400, directory)
    add_chat_template(directory, template)
    add_special_tokens(directory, image_tokens)
    return directory


# A tiny SigLIP vision tower (transformers' SiglipVisionConfig fields): 16 x 16 images, 16 patches of 4 x 4 each.
TINY_SIGLIP_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    image_size=16,
    patch_size=4,
)

# A tiny Qwen3 text model (no vocabulary: each test sets its own); head_dim 16, q/k norms.
TINY_QWEN3_TEXT = dict(
    model_type="qwen3",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
