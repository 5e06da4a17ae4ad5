"""Hugging Face models: a Llama from a local config trained by a swarm (the example), a `Trainer` as a learner
(`DilocoCallback`), and `init-run --task hf:CONFIG.json`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from diloco.coordinator.plan import FragmentPlan  # noqa: E402
from diloco.coordinator.runspec import Genesis  # noqa: E402
from diloco.node.learner import Learner, create_run  # noqa: E402
from diloco.node.tasks import evaluate, make_task  # noqa: E402
from diloco.node.tasks.hf import HFModel  # noqa: E402
from diloco.node.train import task_of  # noqa: E402
from diloco.protocol.identity import Identity  # noqa: E402

from .helpers import cli  # noqa: E402


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=120)
from .swarm_utils import fast_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "hf_llama_tiny.json"


def hf_task(**kw):
    return make_task("hf", hf_config=HFModel.from_file(CONFIG).config, **kw)


@pytest.mark.timeout(300)
def test_the_llama_example_trains_with_two_learners_and_its_eval_loss_falls():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_llama.py"), "--steps", "100",
                          "--inner-steps", "25"], capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(a < b - 1.0 for a, b in zip(result["eval_loss_after"], result["eval_loss_before"], strict=True))
    assert min(result["outer_versions"]) >= 1, "no fragment was merged by the two learners"


def test_every_learner_builds_the_same_llama_with_its_own_parameter_names():
    task = hf_task()
    a, b = task.build_model(), task.build_model()
    assert type(a).__name__ == "LlamaForCausalLM"
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    names = [n for n, _ in a.named_parameters()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    plan = FragmentPlan.from_module(a, 4)
    assert {n for f in plan.fragments for n in f.names} == set(names)
    with pytest.raises(ValueError, match="model_type"):
        HFModel({"vocab_size": 256})
    with pytest.raises(ValueError, match="vocab"):  # bytes need a vocabulary of 256
        make_task("hf", hf_config={**HFModel.from_file(CONFIG).config, "vocab_size": 300})


@pytest.mark.timeout(180)
def test_a_hugging_face_trainer_with_the_callback_is_a_learner(tmp_path):
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    from diloco.node.hf_trainer import DilocoCallback

    task = hf_task(batch_size=4, context=32)
    g = torch.Generator().manual_seed(0)

    class Bytes(Dataset):
        def __len__(self) -> int:
            return 10_000

        def __getitem__(self, i: int) -> dict:
            x, y = task.data.batch(1, task.context, g)
            ids = torch.cat([x[0], y[0, -1:]])
            return {"input_ids": ids, "labels": ids.clone()}

    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    genesis = create_run(Identity.generate(), "hf-trainer", task.build_model(), fragments=2, inner_steps=10,
                         quorum=1)
    # (a TTL of 1 s: alone, an owner publishes after one member TTL, docs/architecture.md §6.5)
    learner = Learner(model, opt, genesis, config=fast_config(member_ttl_s=1.0, member_refresh_s=0.3),
                      checkpoint_dir=tmp_path / "ckpt")
    before = evaluate(model, task)
    steps = 300  # (about 3 s here: several outer rounds once its one-TTL wait alone is over)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=3e-3, report_to=[], use_cpu=True, save_strategy="no", logging_steps=50,
                             disable_tqdm=True,
                             include_num_input_tokens_seen=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Bytes(), optimizers=(opt, None),
                      callbacks=[DilocoCallback(learner)])
    trainer.train()
    assert learner.t == steps and learner.tokens == steps * 4 * (task.context + 1)
    assert all(v.version >= 1 for v in learner.labels), "no outer step from the Trainer's steps"
    assert not learner.swarm.healthy, "the learner was not closed at the end of training"
    assert (tmp_path / "ckpt").is_dir() and any((tmp_path / "ckpt").glob("step-*"))
    assert evaluate(model, task) < before - 1.0


def test_init_run_takes_a_hugging_face_config_and_join_builds_that_model(tmp_path):
    spec_path = tmp_path / "run.spec"
    r = run_cli("init-run", "--name", "llama", "--task", f"hf:{CONFIG}", "--key", str(tmp_path / "k.pem"),
            "--out", str(spec_path))
    assert r.returncode == 0, r.stderr
    spec = Genesis.load(spec_path).spec
    assert spec.task == "hf" and spec.model["hf_config"]["model_type"] == "llama"
    model = task_of(spec).build_model()
    assert FragmentPlan.from_module(model, spec.fragments).digest() == spec.plan_digest
    for bad, why in ((tmp_path / "missing.json", "cannot read"), (tmp_path / "bad.json", "not JSON")):
        if bad.name == "bad.json":
            bad.write_text("{")
        r = run_cli("init-run", "--name", "x", "--task", f"hf:{bad}", "--key", str(tmp_path / "k.pem"),
                "--out", str(tmp_path / "x.spec"))
        assert r.returncode != 0 and why in r.stderr and "Traceback" not in r.stderr
