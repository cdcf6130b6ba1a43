"""The tiny HF configs that CPU tests share: a Llama-style LLM (same as tests/configs/tiny_llm.yaml) and a Qwen2.5-VL text model."""

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
