"""A small GPT for the built-in tasks, in the manner of nanoGPT's model.py.

Token and position embeddings (`wte`, `wpe`), pre-LayerNorm blocks of causal self-attention and an MLP, a final
LayerNorm and a linear head. Every knob lives in `GPTConfig`.

The head is *untied* from `wte`: each parameter is its own tensor, so the swarm can cut the model into fragments
without one tensor belonging to two of them, and `safetensors` (which refuses shared storage) saves it as is.
Initialisation is drawn from a private generator seeded by the caller, so two learners that build
`GPT(config, seed=0)` hold bit-identical weights without agreeing on anything else.

This module never touches the network, files or the global random state's seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    context: int = 64  # longest sequence the position embedding covers
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")

    @classmethod
    def tiny(cls, vocab_size: int = 256, context: int = 64) -> GPTConfig:
        """~0.2M parameters: many inner steps per second on one CPU thread."""
        return cls(vocab_size=vocab_size, context=context, n_layer=4, n_head=4, n_embd=64)

    @classmethod
    def small(cls, vocab_size: int = 256, context: int = 256) -> GPTConfig:
        """~10.9M parameters: a real model for a GPU or a patient CPU."""
        return cls(vocab_size=vocab_size, context=context, n_layer=6, n_head=6, n_embd=384)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # query, key, value for all heads at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, seed: int = 0):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.context, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # untied: see module docstring
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """GPT-2 init from a private generator: N(0, 0.02), residual projections scaled by 1/sqrt(2·n_layer)."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():  # a fixed order, so the draws are the same on every machine
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * self.config.n_layer), generator=g)
            elif name.endswith(".weight") and p.dim() == 2:  # Linear and Embedding
                nn.init.normal_(p, 0.0, 0.02, generator=g)
            elif ".ln_" in name and name.endswith(".weight"):
                nn.init.ones_(p)
            else:  # biases of Linear and LayerNorm
                nn.init.zeros_(p)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx: (B, T) token ids -> logits (B, T, vocab) and the mean cross-entropy against targets, or None."""
        B, T = idx.shape
        if T > self.config.context:
            raise ValueError(f"sequence of length {T} is longer than the model's context {self.config.context}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Extend idx (B, T) by sampling max_new_tokens tokens, feeding back at most `context` of them."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.context:])
            probs = F.softmax(logits[:, -1, :] / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx
