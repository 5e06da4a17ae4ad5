"""The built-in training tasks: a model, a token source and the inner optimizer, bundled under a name.

    task = make_task("markov")                      # or "kjv", or "file:notes.txt", or "hf" (node/tasks/hf.py)
    model = task.build_model()
    opt = task.optimizer(model)
    for x, y in task.batches(learner=0):
        loss = task.loss(model, x, y); opt.zero_grad(); loss.backward(); opt.step()
    print(evaluate(model, task), "vs best possible", task.data.entropy_rate_nats())

Everything here is local computation: no module in this package may import the network layers.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..fsdp import reshard
from .data import Batch, ByteCorpus, CorpusError, MarkovSource, TokenSource, learner_generator
from .hf import HFModel, causal_lm_loss
from .model import GPT, GPTConfig

__all__ = ["TASK_NAMES", "Batch", "ByteCorpus", "CorpusError", "EagerAdamW", "GPT", "GPTConfig", "HFModel", "MarkovSource",
           "Task", "TokenSource", "evaluate", "learner_generator", "make_task"]

TASK_NAMES = ("markov", "kjv", "file:<path>", "hf")
PRESETS = {"tiny": GPTConfig.tiny, "small": GPTConfig.small}


def _eager(method):
    """A `torch.optim.Optimizer` method without its `torch._disable_dynamo` wrapper (the same function)."""
    return getattr(method, "__wrapped__", method)


class EagerAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW`, the same update, state and state_dict, for eager training only.

    torch's optimizers wrap `__init__`'s `add_param_group`, `step`, `zero_grad`, `state_dict` and
    `load_state_dict` in guards against torch.compile, and the first call of any of them imports `torch._dynamo`:
    about as much CPU as `import torch` itself (2.5 s here), paid by every learner at every start, before its
    first inner step, and for nothing in eager mode. This class calls the same functions without the guards, so
    the compiler stack is never imported. Do not use it inside `torch.compile`; `torch.optim.AdamW` is for that.
    """

    add_param_group = _eager(torch.optim.Optimizer.add_param_group)
    zero_grad = _eager(torch.optim.Optimizer.zero_grad)
    state_dict = _eager(torch.optim.Optimizer.state_dict)
    load_state_dict = _eager(torch.optim.Optimizer.load_state_dict)
    _step = inspect.unwrap(torch.optim.AdamW.step)  # under the profiler hook and `_use_grad_for_differentiable`

    def step(self, closure=None):
        with torch.set_grad_enabled(self.defaults["differentiable"]):  # what the guard does, less its graph breaks
            return self._step(closure)


@dataclass
class Task:
    name: str
    model: GPTConfig | HFModel  # the built-in GPT, or a Hugging Face causal LM (task "hf")
    data: TokenSource
    batch_size: int = 16
    context: int = 64
    seed: int = 0  # model init and the learners' data streams
    # inner optimizer: AdamW as in DiLoCo; weight decay on matrices and embeddings only, as nanoGPT
    lr: float = 3e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    warmup_steps: int = 0
    n_eval_batches: int = 8

    def __post_init__(self):
        if self.model.vocab_size != self.data.vocab_size:
            raise ValueError(f"model vocab {self.model.vocab_size} != data vocab {self.data.vocab_size}")
        if self.context > self.model.context:
            raise ValueError(f"task context {self.context} exceeds the model's context {self.model.context}")

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.context

    def build_model(self) -> torch.nn.Module:
        """The same initial weights on every learner: the seed is the task's."""
        if isinstance(self.model, HFModel):
            return self.model.build(self.seed)
        return GPT(self.model, seed=self.seed)

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss of `model` (built by `build_model`) on a batch."""
        if isinstance(self.model, HFModel):
            return causal_lm_loss(model, x, y)
        return model(x, y)[1]

    def optimizer(self, model: torch.nn.Module) -> torch.optim.AdamW:
        """AdamW (`EagerAdamW`: a learner's start does not import torch's compiler stack)."""
        decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return EagerAdamW(groups, lr=self.lr, betas=self.betas)

    def schedule(self, optimizer: torch.optim.Optimizer, total_steps: int | None = None,
                 min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
        """Linear warmup over `warmup_steps`; then cosine down to min_lr_ratio·lr at total_steps, or constant."""
        def factor(step: int) -> float:
            if step < self.warmup_steps:
                return (step + 1) / self.warmup_steps
            if total_steps is None:
                return 1.0
            progress = min((step - self.warmup_steps) / max(total_steps - self.warmup_steps, 1), 1.0)
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def batches(self, learner: int, seed: int | None = None) -> Iterator[Batch]:
        """Learner `learner`'s endless training stream: reproducible, and different from every other learner's."""
        g = learner_generator(self.seed if seed is None else seed, learner)
        while True:
            yield self.data.batch(self.batch_size, self.context, g)


def make_task(name: str, **overrides) -> Task:
    """Build a named task. Overrides may name any `Task` field, any `GPTConfig` field (applied to the model),
    or `model="tiny"|"small"|GPTConfig(...)`. Task "hf" trains a Hugging Face model on the KJV bytes: its
    `hf_config` override is the model's config (a dict, see `HFModel`), and GPTConfig fields do not apply."""
    hf_config = overrides.pop("hf_config", None)
    if name == "markov":
        data: TokenSource = MarkovSource(vocab=64, order=1, seed=0, concentration=0.1)
    elif name in ("kjv", "hf"):
        data = ByteCorpus.kjv()
    elif name.startswith("file:"):
        data = ByteCorpus.from_file(name.removeprefix("file:"))
    else:
        raise ValueError(f"unknown task {name!r}: choose one of {', '.join(TASK_NAMES)}")

    task_fields = {f.name for f in dataclasses.fields(Task)} - {"name"}
    if name == "hf":
        if hf_config is None:
            raise ValueError("task hf needs its model's config: init-run --task hf:CONFIG.json")
        allowed = task_fields - {"model"}  # (the model is the config's)
        if set(overrides) - allowed:
            raise TypeError(f"task hf takes Task fields only ({sorted(allowed)}); got {sorted(set(overrides) - allowed)}")
        task_kw = dict(overrides)
        data = task_kw.pop("data", data)
        return Task(name=name, model=HFModel(hf_config), data=data, **task_kw)
    if hf_config is not None:
        raise TypeError("hf_config is an override of task hf only")
    model_fields = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size"}
    unknown = set(overrides) - task_fields - model_fields
    if unknown:
        raise TypeError(f"unknown override(s) {sorted(unknown)}; known: {sorted(task_fields | model_fields)}")
    task_kw = {k: v for k, v in overrides.items() if k in task_fields and k != "model"}
    model_kw = {k: v for k, v in overrides.items() if k in model_fields and k != "context"}
    data = task_kw.pop("data", data)
    context = task_kw.setdefault("context", 64)

    model = overrides.get("model", "tiny")
    if isinstance(model, str):
        if model not in PRESETS:
            raise ValueError(f"unknown model preset {model!r}: choose one of {', '.join(PRESETS)}")
        model = PRESETS[model](vocab_size=data.vocab_size, context=context)
    model = dataclasses.replace(model, **model_kw)
    return Task(name=name, model=model, data=data, **task_kw)


@torch.no_grad()
def evaluate(model: torch.nn.Module, task: Task) -> float:
    """Mean loss of `model` over the task's fixed held-out batches (the model's train/eval mode is restored)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        losses = [task.loss(model, x.to(device), y.to(device)).item()
                  for x, y in task.data.eval_batches(task.batch_size, task.context, task.n_eval_batches)]
    finally:
        model.train(was_training)
        reshard(model)  # an FSDP2 model keeps its root gathered after a forward without backward
    return sum(losses) / len(losses)
