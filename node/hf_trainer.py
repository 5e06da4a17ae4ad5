"""A Hugging Face `Trainer` as a learner: `DilocoCallback` calls `Learner.step` after every optimizer step.

    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    learner = Learner(model, opt, genesis, config=SwarmConfig(peers=[...]))
    trainer = Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None),
                      callbacks=[DilocoCallback(learner, tokens_per_step=batch * seq_len)])
    trainer.train()            # joins the swarm at the start, leaves it (checkpoint written) at the end

The Learner needs the optimizer the Trainer steps (its state goes into checkpoints), so create it yourself and
hand it to the Trainer with `optimizers=`. `transformers` is an optional extra (`pip install 'diloco-node[hf]'`).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from .learner import Learner


class DilocoCallback(TrainerCallback):
    """`on_train_begin`: start the learner (unless started); `on_step_end` (after each optimizer step, once per
    gradient accumulation cycle): `learner.step`; `on_train_end`: close it, if `close_at_end`.

    `tokens_per_step`: the tokens one optimizer step trains on. Without it the count comes from the Trainer's
    `state.num_input_tokens_seen`, which it keeps only with `TrainingArguments(include_num_input_tokens_seen=True)`.
    An error of the swarm (`SwarmFailed`) ends `trainer.train()`.
    """

    def __init__(self, learner: Learner, tokens_per_step: int | None = None, *, close_at_end: bool = True) -> None:
        if tokens_per_step is not None and (not isinstance(tokens_per_step, int) or tokens_per_step < 0):
            raise ValueError(f"tokens_per_step must be a non-negative int, got {tokens_per_step!r}")
        self.learner, self.tokens_per_step, self.close_at_end = learner, tokens_per_step, close_at_end
        self._seen = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.learner.swarm is None:
            self.learner.start()
        self._seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tokens = self.tokens_per_step
        if tokens is None:
            seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
            tokens, self._seen = seen - self._seen, seen
            if tokens <= 0:
                raise ValueError("DilocoCallback cannot count tokens: pass tokens_per_step, or set "
                                 "TrainingArguments(include_num_input_tokens_seen=True)")
        loss = None
        for entry in reversed(getattr(state, "log_history", None) or []):
            if "loss" in entry:
                loss = float(entry["loss"])
                break
        self.learner.step(tokens=tokens, loss=loss)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.close_at_end:
            self.learner.close()
