"""The outer optimizer of one fragment: SGD with Nesterov momentum on the merged delta (docs/architecture.md §6.3).

The merged pseudo-gradient Δ = Θ_anchor − θ_local is used as a gradient, exactly as
`torch.optim.SGD(lr, momentum, nesterov=True)` with `grad = Δ` would use it (DiLoCo 2311.08105, Alg. 1), and the
arithmetic is the same op for op, so both give the same bits on the same device. `step` is functional: it
never mutates its inputs. `update_into` is what the owner runs: the same step written as the update
U = Θ^(v+1) − Θ^(v) = −lr·g over the merged delta, the new momentum into a buffer of the caller's; on flat fp32
buffers in one pass (protocol/_kernels.py), each operation rounded on its own, where torch's vectorised
`add(alpha=)` fuses a multiply-add on CPUs that have one: the two may differ in the last bit. The per-fragment state is one momentum tensor, exported as plain
tensors for replicas and checkpoints. No network, no clocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from diloco.protocol import _kernels as K
from diloco.protocol.codecs import plain_fp32
from diloco.protocol.errors import Malformed


def _kernel_takes(momentum: Tensor, delta: Tensor, out: Tensor) -> bool:
    """Contiguous float32 CPU tensors of one length, `delta` overlapping neither of the others (`out` may be
    `momentum`): what `K.momentum_update` is given."""
    if not all(plain_fp32(t) and t.numel() == delta.numel() for t in (momentum, delta, out)):
        return False
    lo, hi = delta.data_ptr(), delta.data_ptr() + 4 * delta.numel()
    return all(t.data_ptr() + 4 * t.numel() <= lo or t.data_ptr() >= hi for t in (momentum, out))


class OuterStep(NamedTuple):
    theta: Tensor  # Θ^(v+1)
    momentum: Tensor | None  # the new momentum buffer (None when momentum = 0)


@dataclass(frozen=True)
class OuterOptimizer:
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"outer lr must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise ValueError("Nesterov momentum needs momentum > 0")

    def step(self, theta: Tensor, delta: Tensor, momentum: Tensor | None = None) -> OuterStep:
        """One outer step of Θ with pseudo-gradient Δ; `momentum` None means a fresh (zero) buffer.

        b' = μ·b + Δ (b' = Δ on the first step);  g = Δ + μ·b' (Nesterov) or b';  Θ' = Θ − lr·g
        (SGD with Nesterov momentum as in DiLoCo 2311.08105 / torch.optim.SGD, dampening 0, no weight decay).
        """
        if theta.shape != delta.shape:
            raise ValueError(f"theta has shape {tuple(theta.shape)}, delta {tuple(delta.shape)}")
        with torch.no_grad():
            grad = delta
            buf = None
            if self.momentum != 0:
                if momentum is None:
                    buf = torch.clone(delta).detach()
                else:
                    if momentum.shape != delta.shape:
                        raise ValueError(
                            f"momentum has shape {tuple(momentum.shape)}, delta {tuple(delta.shape)}"
                        )
                    buf = momentum.mul(self.momentum).add_(delta)
                grad = delta.add(buf, alpha=self.momentum) if self.nesterov else buf
            return OuterStep(theta.add(grad, alpha=-self.lr), buf)

    def update_into(self, delta: Tensor, momentum: Tensor | None = None, out: Tensor | None = None) -> Tensor | None:
        """The same step as `step`, as the update U = Θ' − Θ = −lr·g written over `delta`. The new momentum
        buffer goes into `out` (a fresh tensor when None; `momentum` itself for an in-place step) and is
        returned; `momentum` is read only. Needs no Θ: what an owner runs every round, into a buffer of its own so
        that its committed momentum stays as it was until the version is published."""
        with torch.no_grad():
            buf = None
            if self.momentum != 0:
                if momentum is None:
                    buf = delta.detach().clone() if out is None else out.copy_(delta)
                else:
                    if momentum.shape != delta.shape:
                        raise ValueError(
                            f"momentum has shape {tuple(momentum.shape)}, delta {tuple(delta.shape)}"
                        )
                    if out is None:
                        out = torch.empty_like(momentum)
                    if _kernel_takes(momentum, delta, out):  # one pass instead of torch's four (protocol/_kernels.py)
                        K.momentum_update(momentum.numpy(), delta.numpy(), out.numpy(), np.float32(self.momentum),
                                          np.float32(-self.lr), self.nesterov)
                        return out
                    buf = torch.mul(momentum, self.momentum, out=out)
                    buf.add_(delta)
                if self.nesterov:
                    delta.add_(buf, alpha=self.momentum)
                else:
                    delta.copy_(buf)
            delta.mul_(-self.lr)
            return buf

    def momentum_after(self, momentum: Tensor | None, update: Tensor) -> Tensor:
        """The buffer b' that the step which published `update` (U = −lr·g) left, from the buffer b before it
        (None: the first step). Nesterov: g = Δ + μ·b' and b' = μ·b + Δ, so b' = (μ·b + g) / (1 + μ); plain
        momentum: b' = g. What a replica that missed one replication rebuilds at a takeover, from the update
        every holder received (compressed: b' then carries the codec's error ÷ lr(1 + μ))."""
        if self.momentum == 0:
            raise ValueError("no momentum to rebuild: the outer optimizer has momentum 0")
        with torch.no_grad():
            g = update.mul(-1.0 / self.lr)
            if not self.nesterov:
                return g
            if momentum is not None:
                g.add_(momentum, alpha=self.momentum)
            return g.div_(1.0 + self.momentum)


def export_state(momentum: Tensor | None) -> dict[str, Tensor]:
    """The replicable state of one fragment's outer optimizer as plain tensors (safetensors-friendly)."""
    return {} if momentum is None else {"momentum": momentum.detach().to(torch.float32).contiguous()}


def import_state(state: Mapping[str, Tensor], numel: int) -> Tensor | None:
    """Inverse of `export_state`, checked (it arrives from the owner over the network): raises `Malformed`."""
    extra = set(state) - {"momentum"}
    if extra:
        raise Malformed(f"outer optimizer state has unknown entries {sorted(extra)}")
    if "momentum" not in state:
        return None
    m = state["momentum"]
    if not isinstance(m, Tensor) or m.dtype != torch.float32 or m.dim() != 1 or m.numel() != numel:
        raise Malformed(f"outer momentum must be a 1-D fp32 tensor of {numel} elements")
    if not bool(torch.isfinite(m).all()):
        raise Malformed("outer momentum holds NaN or infinite values")
    return m.clone()
