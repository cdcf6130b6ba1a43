"""Vision-language models: vision encoders (:mod:`.qwen2_5_vit`), the patch-grid layout they share
(:mod:`.patches`)."""
