"""Writes the Pi0.5 parity fixture (tests/fixtures/pi05/) with lerobot's own ``PI05Policy`` (driven by
make_pi05_fixture.sh, in a Python 3.12 venv with lerobot 0.6.x installed ``--no-deps``).

lerobot builds Pi0.5 only at the public sizes (PaliGemma 2B + Gemma 300M, 257k vocabulary), so this script swaps
three size sources for tiny ones before building, and changes nothing else:

- ``modeling_pi05.get_gemma_config``: the backbone and action-expert Gemma sizes (8 heads: lerobot's joint
  attention hard-codes 8 query heads),
- ``modeling_pi05.CONFIG_MAPPING["gemma"]``: the action expert's vocabulary (its unused ``lm_head``),
- ``modeling_pi05.PaliGemmaForConditionalGenerationWithPiGemma``: the SigLIP sizes, projector width and
  vocabulary that lerobot sets on the PaliGemma config just before building it.

Every parameter is then redrawn from a seeded generator (so the Gemma norms, adaRMS modulations and gates are
not at their zero initialisation), and the script saves, with lerobot's ``save_pretrained``:

- ``config.json`` / ``model.safetensors``: lerobot's policy config and state dict (lerobot's key layout),
- ``tiny_sizes.json``: the tiny sizes, lerobot / torch / transformers versions, seeds and the prompts lerobot
  built from each state and task (``Pi05PrepareStateTokenizerProcessorStep``),
- ``tokenizer/``: a tiny word-level tokenizer (PaliGemma's special-token ids: pad 0, eos 1, bos 2, unk 3),
- ``inputs.safetensors``: raw camera images (non-square, so lerobot resizes with padding; a third configured
  camera is missing and becomes an empty, masked one), normalised state, actions, the noise and flow times of
  the loss and the noise of sampling, and the token ids / masks lerobot's ``TokenizerProcessorStep`` produced,
- ``expected.safetensors``: the prefix embeddings, the per-element loss of ``PI05Pytorch.forward``, the policy's
  mean loss, ``sample_actions`` on the padded action dimensions and ``predict_action_chunk``,
- ``pi05_base_layout.json``: every state-dict key and shape of the public-size policy (built on the meta device
  before the sizes are swapped): the layout lerobot 0.6.1 saves at the public size.

Usage: python scripts/make_pi05_fixture.py --out tests/fixtures/pi05
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

SEED = 1234
BATCH = 2
NUM_STEPS = 4
TASKS = ["push_the block\n", "lift the cube"]
# Normalised states (lerobot discretises values in [-1, 1] into 256 bins; -1.05 falls below the first bin).
STATES = [[-1.05, 0.0, 0.37], [1.0, -1.0, -0.2]]
RAW_IMAGE_HW = (24, 40)
CAMERAS = ["observation.images.base", "observation.images.wrist", "observation.images.right"]
PRESENT_CAMERAS = CAMERAS[:2]

TINY = {
    "vision": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "patch_size": 8,
        "image_size": 32,
        "layer_norm_eps": 1e-6,
    },
    "llm": {"width": 64, "depth": 2, "mlp_dim": 128, "num_heads": 8, "num_kv_heads": 1, "head_dim": 16},
    "action_expert": {
        "width": 32,
        "depth": 2,
        "mlp_dim": 64,
        "num_heads": 8,
        "num_kv_heads": 1,
        "head_dim": 16,
    },
    "chunk_size": 5,
    "max_state_dim": 8,
    "max_action_dim": 6,
    "state_dim": 3,
    "action_dim": 4,
    "tokenizer_max_length": 20,
}


def tiny_vocabulary() -> list[str]:
    """Tokens of the tiny word-level tokenizer: PaliGemma's special ids first, then prompt words and numbers."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    words = ["Task", "State", "Action", ":", ",", ";", "-", "push", "the", "block", "lift", "cube"]
    return specials + words + [str(i) for i in range(256)]


def build_tokenizer(directory: Path) -> object:
    """Builds and saves the tiny tokenizer (BOS prepended, as PaliGemma's tokenizer does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(tiny_vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(directory)
    return fast


def patch_lerobot_sizes() -> None:
    """Makes lerobot build the TINY sizes (see the module docstring)."""
    from lerobot.policies.pi05 import modeling_pi05 as m

    vocab_size = len(tiny_vocabulary())
    variants = {"gemma_2b": TINY["llm"], "gemma_300m": TINY["action_expert"]}
    m.get_gemma_config = lambda variant: m.GemmaConfig(**variants[variant])
    real_mapping = m.CONFIG_MAPPING
    m.CONFIG_MAPPING = {
        "paligemma": real_mapping["paligemma"],
        "gemma": lambda **kwargs: real_mapping["gemma"](**{**kwargs, "vocab_size": vocab_size}),
    }
    real_paligemma = m.PaliGemmaForConditionalGenerationWithPiGemma

    def tiny_paligemma(config: object) -> object:
        for key, value in TINY["vision"].items():
            setattr(config.vision_config, key, value)
        config.vision_config.projection_dim = TINY["llm"]["width"]
        config.text_config.vocab_size = vocab_size
        config._vocab_size = vocab_size
        config.image_token_index = vocab_size - 1
        return real_paligemma(config)

    m.PaliGemmaForConditionalGenerationWithPiGemma = tiny_paligemma


def full_size_layout() -> dict[str, list[int]]:
    """Key -> shape of a public-size ``PI05Policy`` state dict (``model.`` prefix included), built on meta."""
    from lerobot.policies.pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Pytorch

    with torch.device("meta"):
        model = PI05Pytorch(PI05Config(device="cpu", push_to_hub=False, dtype="float32"))
    return {f"model.{key}": list(value.shape) for key, value in model.state_dict().items()}


def make_policy() -> object:
    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.policies.pi05 import PI05Config, PI05Policy

    size = TINY["vision"]["image_size"]
    inputs = {key: PolicyFeature(type=FeatureType.VISUAL, shape=(3, size, size)) for key in CAMERAS}
    inputs["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(TINY["state_dim"],))
    config = PI05Config(
        input_features=inputs,
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(TINY["action_dim"],))},
        device="cpu",
        push_to_hub=False,
        dtype="float32",
        chunk_size=TINY["chunk_size"],
        n_action_steps=TINY["chunk_size"],
        max_state_dim=TINY["max_state_dim"],
        max_action_dim=TINY["max_action_dim"],
        image_resolution=(size, size),
        tokenizer_max_length=TINY["tokenizer_max_length"],
        num_inference_steps=NUM_STEPS,
    )
    policy = PI05Policy(config)
    randomise_(policy, torch.Generator().manual_seed(SEED))
    return policy.eval()


@torch.no_grad()
def randomise_(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Redraws every parameter: matrices ~ N(0, 1/fan_in), vectors around their initial value (1 or 0)."""
    for _, param in sorted(module.named_parameters(), key=lambda item: item[0]):
        noise = torch.randn(param.shape, generator=generator)
        if param.ndim >= 2:
            param.copy_(noise / math.sqrt(param[0].numel()))
        else:
            base = 1.0 if bool((param == 1).all()) else 0.0
            param.copy_(base + 0.1 * noise)


def make_inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED + 1)
    chunk, action_dim = TINY["chunk_size"], TINY["action_dim"]
    inputs = {key: torch.rand(BATCH, 3, *RAW_IMAGE_HW, generator=generator) for key in PRESENT_CAMERAS}
    inputs["observation.state"] = torch.tensor(STATES, dtype=torch.float32)
    inputs["action"] = torch.rand(BATCH, chunk, action_dim, generator=generator) * 2 - 1
    inputs["noise"] = torch.randn(BATCH, chunk, TINY["max_action_dim"], generator=generator)
    inputs["time"] = torch.tensor([0.3, 0.85])
    inputs["sample_noise"] = torch.randn(BATCH, chunk, TINY["max_action_dim"], generator=generator)
    return inputs


def tokenize_with_lerobot(inputs: dict[str, torch.Tensor], tokenizer: object) -> tuple[list[str], dict]:
    """lerobot's Pi0.5 prompt (discretised state) and tokenizer steps, as its pre-processor runs them."""
    from lerobot.lerobot_types import TransitionKey
    from lerobot.policies.pi05.processor_pi05 import Pi05PrepareStateTokenizerProcessorStep
    from lerobot.processor import TokenizerProcessorStep

    transition = {
        TransitionKey.OBSERVATION: {"observation.state": inputs["observation.state"].clone()},
        TransitionKey.COMPLEMENTARY_DATA: {"task": list(TASKS)},
    }
    transition = Pi05PrepareStateTokenizerProcessorStep(max_state_dim=TINY["max_state_dim"])(transition)
    prompts = list(transition[TransitionKey.COMPLEMENTARY_DATA]["task"])
    step = TokenizerProcessorStep(
        tokenizer=tokenizer,
        max_length=TINY["tokenizer_max_length"],
        padding_side="right",
        padding="max_length",
    )
    observation = step(transition)[TransitionKey.OBSERVATION]
    tokens = {
        "tokens": observation["observation.language.tokens"],
        "token_mask": observation["observation.language.attention_mask"],
    }
    return prompts, tokens


@torch.no_grad()
def run_reference(policy: object, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from lerobot.policies.common.vla_utils import pad_vector

    batch = {key: inputs[key] for key in [*PRESENT_CAMERAS, "observation.state", "action"]}
    batch["observation.language.tokens"] = inputs["tokens"]
    batch["observation.language.attention_mask"] = inputs["token_mask"]
    model = policy.model
    images, image_masks = policy._preprocess_images(batch)
    prefix_embs, _, _ = model.embed_prefix(images, image_masks, inputs["tokens"], inputs["token_mask"])
    actions = pad_vector(inputs["action"], TINY["max_action_dim"])
    loss_elements = model.forward(
        images, image_masks, inputs["tokens"], inputs["token_mask"], actions, inputs["noise"], inputs["time"]
    )
    # The policy draws its own noise and time: hand it the fixture's.
    model.sample_noise = lambda shape, device: inputs["noise"].clone()
    model.sample_time = lambda batch_size, device: inputs["time"].clone()
    loss_mean, _ = policy.forward(batch)
    sampled = model.sample_actions(
        images, image_masks, inputs["tokens"], inputs["token_mask"], noise=inputs["sample_noise"].clone()
    )
    model.sample_noise = lambda shape, device: inputs["sample_noise"].clone()
    chunk = policy.predict_action_chunk(batch)
    return {
        "prefix_embs": prefix_embs,
        "images_preprocessed": torch.stack(images, dim=1),
        "image_masks": torch.stack(image_masks, dim=1),
        "loss_elements": loss_elements,
        "loss_mean": loss_mean.reshape(1),
        "sample_actions": sampled,
        "predict_action_chunk": chunk,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import lerobot
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(args.out / "tokenizer")
    layout = full_size_layout()
    lines = [f"  {json.dumps(key)}: {json.dumps(shape)}" for key, shape in layout.items()]
    (args.out / "pi05_base_layout.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")
    patch_lerobot_sizes()
    policy = make_policy()
    inputs = make_inputs()
    prompts, tokens = tokenize_with_lerobot(inputs, tokenizer)
    inputs.update(tokens)
    expected = run_reference(policy, inputs)
    policy.save_pretrained(args.out)
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(args.out / "inputs.safetensors"))
    save_file({k: v.contiguous() for k, v in expected.items()}, str(args.out / "expected.safetensors"))
    meta = {
        "made_by": {
            "lerobot": lerobot.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "sizes": TINY,
        "vocab_size": len(tiny_vocabulary()),
        "seed": SEED,
        "num_inference_steps": NUM_STEPS,
        "cameras": CAMERAS,
        "present_cameras": PRESENT_CAMERAS,
        "tasks": TASKS,
        "prompts": prompts,
    }
    (args.out / "tiny_sizes.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"loss {expected['loss_mean'].item():.6f}; wrote {sorted(p.name for p in args.out.iterdir())}")


if __name__ == "__main__":
    main()
