"""The built-in tasks: the small GPT, the token sources and the task registry."""

import math

import pytest
import torch

from diloco.node.tasks import (
    GPT,
    ByteCorpus,
    CorpusError,
    GPTConfig,
    MarkovSource,
    evaluate,
    learner_generator,
    make_task,
)

torch.set_num_threads(1)
TINY = GPTConfig(vocab_size=64, context=32, n_layer=2, n_head=2, n_embd=32)


def test_forward_shapes_and_loss_at_init_is_ln_vocab():
    model = GPT(TINY, seed=0)
    x = torch.randint(0, 64, (3, 32))
    logits, loss = model(x, torch.randint(0, 64, (3, 32)))
    assert logits.shape == (3, 32, 64)
    assert loss.shape == () and abs(loss.item() - math.log(64)) < 0.05
    assert model(x)[1] is None
    with pytest.raises(ValueError, match="longer than the model's context"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_future_tokens_do_not_change_past_logits():
    model = GPT(TINY, seed=0).eval()
    x = torch.randint(0, 64, (2, 32))
    y = x.clone()
    y[:, 20:] = torch.randint(0, 64, (2, 12))
    assert not torch.allclose(model(x)[0][:, 20:], model(y)[0][:, 20:])
    torch.testing.assert_close(model(x)[0][:, :20], model(y)[0][:, :20])


def test_init_is_a_function_of_the_seed_alone():
    torch.manual_seed(123)
    a = GPT(TINY, seed=7).state_dict()
    torch.manual_seed(456)
    b = GPT(TINY, seed=7).state_dict()
    c = GPT(TINY, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["transformer.wte.weight"], c["transformer.wte.weight"])
    assert a["lm_head.weight"].data_ptr() != a["transformer.wte.weight"].data_ptr()  # untied head


def test_presets_stay_in_their_size_class():
    assert 200_000 <= GPT(GPTConfig.tiny(vocab_size=256)).num_params() <= 1_000_000
    assert GPTConfig.small().n_embd > GPTConfig.tiny().n_embd


@pytest.mark.parametrize("vocab,order", [(16, 1), (8, 2)])
def test_markov_entropy_rate_equals_monte_carlo_log_loss_of_the_true_chain(vocab, order):
    src = MarkovSource(vocab=vocab, order=order, seed=3, concentration=0.3)
    P, pi = src.transition, src.stationary
    # π is stationary: π(s) = Σ_a π(a, s[:-1]) P(s[-1] | a, s[:-1])
    joint = (pi[:, None] * P).reshape(vocab, -1)
    torch.testing.assert_close(joint.sum(0), pi)
    # the mean surprisal of the true chain along long samples converges to the entropy rate
    seq = src.sample(256, 400, torch.Generator().manual_seed(0))
    state = sum(seq[:, j:seq.shape[1] - order + j] * vocab ** (order - 1 - j) for j in range(order))
    surprisal = -torch.log(P[state, seq[:, order:]])
    assert abs(surprisal.mean().item() - src.entropy_rate_nats()) < 0.02
    assert 0 < src.entropy_rate_nats() < math.log(vocab)


def test_kjv_corpus_loads_from_the_installed_package():
    corpus = ByteCorpus.kjv()
    assert corpus.vocab_size == 256 and len(corpus.train) > 3_000_000
    assert b"In the beginning God created" in bytes(corpus.train[:2000].tolist())
    assert b"1:1" not in bytes(corpus.train[:2000].tolist())  # verse numbers are stripped
    x, y = corpus.batch(4, 64, torch.Generator().manual_seed(0))
    assert x.shape == (4, 64) and x.dtype == torch.long and torch.equal(x[:, 1:], y[:, :-1])


def test_file_corpus_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(CorpusError, match="not found"):
        ByteCorpus.from_file(tmp_path / "missing.txt")
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(CorpusError, match="need at least"):
        ByteCorpus.from_file(tmp_path / "short.txt")
    (tmp_path / "ok.txt").write_bytes(bytes(range(256)) * 40)
    corpus = ByteCorpus.from_file(tmp_path / "ok.txt")
    with pytest.raises(CorpusError, match="shorter than context"):
        corpus.eval_batches(2, 1024, 1)
    task = make_task(f"file:{tmp_path / 'ok.txt'}")
    assert task.data.vocab_size == task.model.vocab_size == 256


def test_eval_batches_are_fixed_held_out_sets():
    for src in (MarkovSource(vocab=16), ByteCorpus(bytes(range(256)) * 40)):
        a, b = src.eval_batches(4, 16, 3), src.eval_batches(4, 16, 3)
        assert len(a) == 3 and all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))
    corpus = ByteCorpus(bytes(range(256)) * 40)
    x, _ = corpus.eval_batches(1, 16, 1)[0]
    assert bytes(x[0].tolist()) in bytes(corpus.held_out.tolist())


def test_learner_streams_are_reproducible_and_differ_between_learners():
    task = make_task("markov")
    first = [next(task.batches(learner=i))[0] for i in (0, 0, 1)]
    assert torch.equal(first[0], first[1])
    assert not torch.equal(first[0], first[2])
    assert not torch.equal(next(task.batches(learner=0, seed=1))[0], first[0])
    g0, g1 = learner_generator(0, 0), learner_generator(0, 0)
    assert torch.equal(torch.rand(4, generator=g0), torch.rand(4, generator=g1))


def test_make_task_routes_overrides_and_rejects_unknown_names():
    task = make_task("markov", n_layer=2, lr=1e-3, context=32)
    assert task.model.n_layer == 2 and task.lr == 1e-3 and task.context == task.model.context == 32
    assert task.model.vocab_size == 64
    with pytest.raises(ValueError, match="unknown task"):
        make_task("imagenet")
    with pytest.raises(TypeError, match="unknown override"):
        make_task("markov", learning_rate=1.0)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        make_task("markov", model=GPTConfig.tiny(vocab_size=64, context=16))


def test_tiny_gpt_trains_on_markov_toward_the_entropy_floor():
    # Measured: eval 4.17 (= ln 64) at init -> ~2.57 after 150 steps, floor 2.35 (~88% of the gap closed).
    task = make_task("markov")
    model = task.build_model()
    opt = task.optimizer(model)
    floor, start = task.data.entropy_rate_nats(), evaluate(model, task)
    assert abs(start - math.log(64)) < 0.05
    stream = task.batches(learner=0)
    for _ in range(150):
        x, y = next(stream)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    end = evaluate(model, task)
    assert model.training
    assert end > floor - 0.02  # nothing beats the true chain (up to eval-set noise)
    assert end - floor < 0.25 * (start - floor), f"eval {end:.3f} from {start:.3f}, floor {floor:.3f}"


def test_the_task_optimizer_is_torch_adamw_bit_for_bit_without_importing_dynamo():
    """`EagerAdamW` skips torch.optim's torch.compile guards (their first call imports torch._dynamo, ~2.5 s of
    every learner start): the same updates and state_dict as torch.optim.AdamW, checkpoint round trip included."""
    import subprocess
    import sys

    task = make_task("markov")
    a, b = task.build_model(), task.build_model()
    opt_a = task.optimizer(a)
    groups = [{"params": [p for p in b.parameters() if p.dim() >= 2], "weight_decay": task.weight_decay},
              {"params": [p for p in b.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt_b = torch.optim.AdamW(groups, lr=task.lr, betas=task.betas)
    assert isinstance(opt_a, torch.optim.AdamW)
    stream = task.batches(learner=0)
    for i in range(6):
        x, y = next(stream)
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
            opt.step()
        if i == 2:  # a checkpoint round trip of the eager optimizer's state
            opt_a.load_state_dict(opt_a.state_dict())
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sb["state"]:
        assert all(torch.equal(sa["state"][i][k], sb["state"][i][k]) for k in sb["state"][i])
    with torch.enable_grad():
        assert opt_a.step(closure=lambda: a(*next(stream))[1]).requires_grad  # closure: grad on, like torch's

    code = ("import sys, torch\nfrom diloco.node.tasks import make_task\nt = make_task('markov')\n"
            "m = t.build_model(); o = t.optimizer(m)\nx, y = next(t.batches(learner=0))\n"
            "o.zero_grad(); m(x, y)[1].backward(); o.step(); o.load_state_dict(o.state_dict())\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_bf16_precision_runs_the_forward_in_bf16_and_keeps_the_parameters_fp32():
    from diloco.node.train import TrainOptions, _inner_step

    task = make_task("markov")
    model = task.build_model()
    opt = task.optimizer(model)
    seen: list[torch.dtype] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    stream = task.batches(learner=0)
    losses = [_inner_step(task, model, opt, stream, TrainOptions(precision="bf16")) for _ in range(40)]
    _inner_step(task, model, opt, stream, TrainOptions())
    hook.remove()
    assert seen[:40] == [torch.bfloat16] * 40 and seen[40] == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(math.isfinite(v) for v in losses) and sum(losses[-5:]) / 5 < losses[0] - 0.3
