"""A tiny character-level GPT that reports its largest pre-softmax attention logit.

Pre-LayerNorm blocks as in nanoGPT, written out by hand because the attention scores
themselves are what we watch: ``F.scaled_dot_product_attention`` never exposes them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. The defaults are the seed's unstable setup."""

    vocab_size: int = 41
    """Number of token ids (the world's alphabet)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``d_model``."""
    d_model: int = 64
    """Width of the residual stream."""
    block_size: int = 64
    """Context length in characters."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches (0 reproduces the seed)."""
    qk_norm: bool = False
    """LayerNorm on queries and keys, which bounds the attention logits (off in the seed)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of the weights."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r} must be a positive integer")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} must be divisible by n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")
        if not (math.isfinite(self.init_std) and self.init_std > 0):  # NaN passes "<= 0"
            raise ValueError(f"GPTConfig.init_std={self.init_std} must be finite and positive")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class GPTOutput(NamedTuple):
    logits: torch.Tensor  # (B, T, vocab)
    loss: torch.Tensor | None  # scalar mean cross-entropy in nats
    max_logit: torch.Tensor  # scalar, detached: largest pre-softmax attention logit


def _ignore_saved_mask(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """Checkpoints written before the mask left them still hold it: the same causal mask,
    derived from block_size, so it is dropped rather than refused as an unexpected key."""
    state_dict.pop(prefix + "mask", None)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.attn_drop = nn.Dropout(config.dropout)
        self.resid_drop = nn.Dropout(config.dropout)
        head_dim = config.d_model // config.n_head
        self.q_norm = nn.LayerNorm(head_dim) if config.qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(head_dim) if config.qk_norm else nn.Identity()
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        # Derived from block_size, so not saved: 4 KB and one tensor a layer per checkpoint.
        mask = mask.view(1, 1, config.block_size, config.block_size)
        self.register_buffer("mask", mask, persistent=False)
        self.mask: torch.Tensor
        self.register_load_state_dict_pre_hook(_ignore_saved_mask)  # type: ignore[no-untyped-call]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))  # (B, nh, T, T)
        scores = scores.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        max_logit = scores.detach().amax()  # masked entries are -inf, so never the max
        att = self.attn_drop(F.softmax(scores, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_drop(self.proj(y)), max_logit


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.ReLU(),
            nn.Linear(4 * config.d_model, config.d_model),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attn_out, max_logit = self.attn(self.ln_1(x))
        x = x + attn_out
        x = x + self.mlp(self.ln_2(x))
        return x, max_logit


class TinyGPT(nn.Module):
    """Character GPT: token + position embeddings, ``n_layer`` blocks, linear output head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> GPTOutput:
        T = idx.size(1)  # idx: (B, T)
        if self.config.block_size < T:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        max_logits = []
        for block in self.blocks:
            x, block_max = block(x)
            max_logits.append(block_max)
        logits = self.head(self.ln_f(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return GPTOutput(logits, loss, torch.stack(max_logits).amax())


def build_model(config: GPTConfig, seed: int) -> TinyGPT:
    """The model initialised from ``seed`` alone, without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyGPT(config)
