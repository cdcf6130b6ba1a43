"""The ``optimizer.muon`` section: Muon's hyper-parameters and which parameters it takes.

Muon orthogonalises the momentum of each hidden weight matrix (Keller Jordan, "Muon: An optimizer for hidden layers
in neural networks", 2024); the other parameters (embeddings, output heads, norms, biases, convolutions) are updated
with AdamW inside the same optimizer, with ``optimizer.lr`` / ``optimizer.weight_decay`` / ``optimizer.betas`` /
``optimizer.eps``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ADJUST_LR_FNS = ("original", "match_rms_adamw")
NS_DTYPES = ("bfloat16", "float32")

DEFAULT_ADAMW_PARAMS = (
    # LLM input embeddings and output heads (HF names; nn.Embedding tables go to AdamW by type as well).
    "*embed_tokens*",
    "*lm_head*",
    # megatron-core twins: VocabParallelEmbedding tables and the output layer.
    "*word_embeddings*",
    "*position_embedding*",
    "*output_layer*",
    # Wan DiT and vision towers: the patch embedding (a convolution) and the DiT's output projection.
    "*patch_embed*",
    "*proj_out*",
    # Pi0.5: the action expert's projections from and to the (low-dimensional) action space.
    "*action_in_proj*",
    "*action_out_proj*",
)
"""Parameter-name patterns sent to AdamW by default: the input and output layers of every family.

Hidden-to-hidden maps of dense inputs (Wan's time / text condition embedders, VLM projectors, Pi0.5's time MLP
and adaptive-norm projections, MoE routers) are matrices like any other and stay on Muon."""


@dataclass(kw_only=True)
class MuonOptions:
    """Muon's settings (``optimizer: {name: muon, muon: {...}}``); the defaults are ``torch.optim.Muon``'s.

    Args:
        lr: Muon's peak learning rate; ``None``: ``optimizer.lr``. With ``adjust_lr_fn: original`` Muon wants a
            larger rate than AdamW (e.g. 0.02); ``match_rms_adamw`` scales updates to AdamW's RMS, so
            ``optimizer.lr`` can serve both. A component's own learning rate (VLM / diffusion / embodied modules)
            scales its Muon rate by the same ratio: ``lr * component_lr / optimizer.lr``.
        weight_decay: Muon's decoupled weight decay; ``None``: ``optimizer.weight_decay``.
        momentum: momentum coefficient.
        nesterov: Nesterov momentum.
        ns_steps: Newton-Schulz iterations.
        ns_coefficients: the quintic Newton-Schulz coefficients ``(a, b, c)``.
        eps: added to the norm the update is divided by before Newton-Schulz.
        adjust_lr_fn: the learning rate of an ``A x B`` matrix: ``original`` ``lr * sqrt(max(1, A / B))``;
            ``match_rms_adamw`` ``lr * 0.2 * sqrt(max(A, B))`` (Moonlight, Liu et al. 2025).
        ns_dtype: dtype of the Newton-Schulz iteration: ``bfloat16`` or ``float32``.
        split_fused: orthogonalise fused matrices part by part (MoE ``gate_up_proj`` stacks as gate and up,
            DeepSeek's ``kv_a_proj_with_mqa`` as latent and rotary key), as the unfused model would.
        adamw_params: ``fnmatch`` patterns on full parameter names sent to AdamW (default
            :data:`DEFAULT_ADAMW_PARAMS`; replacing the list drops the defaults).
        muon_params: ``fnmatch`` patterns on full parameter names forced to Muon, over ``adamw_params`` and the
            embedding rule. Each must match a trainable parameter of two dimensions (or an MoE expert stack).
    """

    lr: float | None = None
    weight_decay: float | None = None
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    eps: float = 1e-7
    adjust_lr_fn: str = "original"
    ns_dtype: str = "bfloat16"
    split_fused: bool = True
    adamw_params: list[str] = field(default_factory=lambda: list(DEFAULT_ADAMW_PARAMS))
    muon_params: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"optimizer.muon.lr ({self.lr}) must be positive (or null for optimizer.lr)")
        if self.weight_decay is not None and self.weight_decay < 0:
            raise ValueError(
                f"optimizer.muon.weight_decay ({self.weight_decay}) must be >= 0 (or null for optimizer.weight_decay)"
            )
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"optimizer.muon.momentum ({self.momentum}) must be in [0, 1)")
        if isinstance(self.ns_steps, bool) or not isinstance(self.ns_steps, int) or self.ns_steps < 1:
            raise ValueError(f"optimizer.muon.ns_steps ({self.ns_steps!r}) must be a positive integer")
        self.ns_coefficients = tuple(float(c) for c in self.ns_coefficients)
        if len(self.ns_coefficients) != 3:
            raise ValueError(
                f"optimizer.muon.ns_coefficients ({list(self.ns_coefficients)}) must be three numbers (a, b, c)"
            )
        if self.eps <= 0:
            raise ValueError(f"optimizer.muon.eps ({self.eps}) must be positive")
        if self.adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(
                f"optimizer.muon.adjust_lr_fn ({self.adjust_lr_fn!r}) must be one of {ADJUST_LR_FNS}"
            )
        if self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"optimizer.muon.ns_dtype ({self.ns_dtype!r}) must be one of {NS_DTYPES}")
        for key in ("adamw_params", "muon_params"):
            patterns = getattr(self, key)
            if isinstance(patterns, str) or not all(isinstance(p, str) and p for p in patterns):
                raise ValueError(
                    f"optimizer.muon.{key} ({patterns!r}) must be a list of non-empty parameter-name patterns"
                )
            setattr(self, key, list(patterns))
