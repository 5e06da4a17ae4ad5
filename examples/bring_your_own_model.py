"""Wrap your own PyTorch loop with diloco-node: three learners in this process, one model, no central server.

    .venv/bin/python examples/bring_your_own_model.py

Each learner would normally be its own machine: `Learner(model, optimizer, genesis, config=SwarmConfig(
listen..., peers=[...]))` is all that changes. Here they share a process and take turns stepping.
"""

from __future__ import annotations

import torch

from diloco.node import Learner, SwarmConfig, create_run
from diloco.protocol.identity import Identity

torch.set_num_threads(1)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every learner starts from the same parameters: the run spec pins them
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 16, generator=g)
    return x, (x[:, :4].sum(1, keepdim=True)).sin()


def main() -> None:
    genesis = create_run(Identity.generate(), "byo-model", make_model(), fragments=2, inner_steps=20, quorum=2)
    learners, models, opts = [], [], []
    for _ in range(3):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        peers = [learners[0].swarm.url] if learners else []
        learner = Learner(model, opt, genesis, config=SwarmConfig(peers=peers, member_poll_s=0.5))
        learner.start()  # joins the swarm; downloads newer fragments if there are any
        learners.append(learner)
        models.append(model)
        opts.append(opt)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    for step in range(1, 301):
        for learner, model, opt, g in zip(learners, models, opts, gens, strict=True):
            x, y = batch(g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            learner.step(tokens=len(x), loss=loss.item())  # the one line diloco-node adds to your loop
        if step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f}, fragment versions {[str(v) for v in learners[0].labels]}")
    for learner in learners:
        learner.close()


if __name__ == "__main__":
    main()
