"""Hugging Face causal language models as the model of a task (`transformers` is an optional extra).

A run names its model by a `transformers` config (a Llama, a GPT-2, anything `AutoModelForCausalLM` builds),
stored whole in the RunSpec (`init-run --task hf:CONFIG.json` reads the file), so every learner builds the same
architecture with the same initial weights from the spec alone: nothing is downloaded. The model keeps its own
parameter names; the fragment plan, the run id and checkpoints use them as they are.

The built-in data are bytes, so the config's `vocab_size` must be 256 and `max_position_embeddings` must cover
the task's context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

MAX_CONFIG_BYTES = 1 << 20


class HFUnavailable(ImportError):
    """`transformers` is not installed: `pip install 'diloco-node[hf]'`."""


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise HFUnavailable(f"this run's model is a Hugging Face model, and transformers is not installed ({e}); "
                            "install it with: pip install 'diloco-node[hf]'") from None
    return transformers


@dataclass(frozen=True)
class HFModel:
    """A `transformers` causal LM given by its config (a JSON-able dict with a `model_type`)."""

    config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.config, dict) or not isinstance(self.config.get("model_type"), str):
            raise ValueError("a Hugging Face config must be a JSON object with a \"model_type\" (e.g. \"llama\")")

    @classmethod
    def from_file(cls, path: str | Path) -> HFModel:
        """Read a `config.json` as `save_pretrained` writes it, or a hand-written one."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read the Hugging Face config {path}: {e.strerror or e}") from None
        if len(raw) > MAX_CONFIG_BYTES:
            raise ValueError(f"{path} is {len(raw)} bytes; a model config is at most {MAX_CONFIG_BYTES}")
        try:
            config = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{path} is not JSON: {e}") from None
        return cls(config)

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size", 0))

    @property
    def context(self) -> int:
        return int(self.config.get("max_position_embeddings") or self.config.get("n_positions") or 0)

    def hf_config(self):
        tf = _transformers()
        fields = {k: v for k, v in self.config.items() if k != "model_type"}
        try:
            return tf.AutoConfig.for_model(self.config["model_type"], **fields)
        except (ValueError, KeyError) as e:
            raise ValueError(f"transformers cannot build a config of model_type {self.config['model_type']!r}: "
                             f"{e}") from None

    def build(self, seed: int) -> torch.nn.Module:
        """The model with the run's initial weights: the same on every learner (the global RNG is left as it
        was). Dropout is whatever the config says; `eval()` turns it off for evaluation."""
        tf = _transformers()
        config = self.hf_config()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = tf.AutoModelForCausalLM.from_config(config)
        model.train()
        return model


def causal_lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a Hugging Face causal LM: `y` is `x` shifted by one already."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
