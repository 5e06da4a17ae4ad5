"""A Hugging Face Llama trained by a two-learner swarm through the Python API, on the KJV text, byte-level.

    .venv/bin/pip install -e '.[hf]'          # transformers is an optional extra
    .venv/bin/python examples/hf_llama.py [--steps 300] [--config examples/hf_llama_tiny.json]

The model is built from a local config (no download): any causal LM `transformers` can build from a config
works, with a vocabulary of 256 (bytes). Both learners share this process and take turns stepping; each would
normally be its own machine. The first calls `learner.step()` after its optimizer step; the second leaves its
loop untouched and uses `learner.attach(optimizer)`. The same run from the CLI:
`diloco-node init-run --name llama --task hf:examples/hf_llama_tiny.json`, then `diloco-node join --run run.spec`.
The last line is JSON: the eval loss of each learner before and after.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from diloco.node import Learner, SwarmConfig, create_run
from diloco.node.tasks import evaluate, make_task
from diloco.node.tasks.hf import HFModel
from diloco.protocol.identity import Identity

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="inner steps of each learner")
    ap.add_argument("--config", type=Path, default=HERE / "hf_llama_tiny.json", help="a transformers config.json")
    ap.add_argument("--inner-steps", type=int, default=50, help="H")
    args = ap.parse_args()
    torch.set_num_threads(1)

    task = make_task("hf", hf_config=HFModel.from_file(args.config).config, batch_size=8, context=64)
    genesis = create_run(Identity.generate(), "hf-llama", task.build_model(), fragments=4,
                         inner_steps=args.inner_steps, quorum=2)
    models = [task.build_model() for _ in range(2)]  # the same initial weights: the spec pins them
    opts = [task.optimizer(m) for m in models]
    first = Learner(models[0], opts[0], genesis, config=SwarmConfig(member_poll_s=0.5)).start()
    second = Learner(models[1], opts[1], genesis, config=SwarmConfig(peers=[first.swarm.url], member_poll_s=0.5))
    second.start()
    tokens = task.tokens_per_batch
    attached = second.attach(opts[1], tokens=tokens)  # its loop below has no learner call at all
    before = [evaluate(m, task) for m in models]
    streams = [task.batches(learner=i) for i in range(2)]
    try:
        for step in range(1, args.steps + 1):
            for i, (model, opt) in enumerate(zip(models, opts, strict=True)):
                x, y = next(streams[i])
                loss = task.loss(model, x, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if i == 0:
                    first.step(tokens=tokens, loss=loss.item())
            if step % 50 == 0:
                print(f"step {step}: loss {loss.item():.3f}, versions {[str(v) for v in first.labels]}", flush=True)
        after = [evaluate(m, task) for m in models]
    finally:
        attached.remove()
        second.close()
        first.close()
    print(json.dumps({"params": sum(p.numel() for p in models[0].parameters()), "eval_loss_before": before,
                      "eval_loss_after": after, "outer_versions": [v.version for v in first.labels]}))


if __name__ == "__main__":
    main()
