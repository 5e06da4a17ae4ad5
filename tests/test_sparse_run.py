"""A run of the sparse codec (`topk`): its RunSpec, and learners in one process training through it."""

import pytest
import torch
from click.testing import CliRunner

from diloco.coordinator.runspec import SPARSE_DEFAULTS, Genesis, RunSpec, codec_defaults
from diloco.coordinator.wire import anchor_digest
from diloco.node.cli import main
from diloco.protocol.codecs import get_codec
from diloco.protocol.errors import Malformed

from .swarm_utils import LocalLearner, tiny_run, wait_until


def test_a_sparse_run_gets_its_outer_optimizer_unless_the_fields_name_one() -> None:
    spec = tiny_run(codec="topk").spec
    assert (spec.outer_lr, spec.outer_momentum) == (SPARSE_DEFAULTS["outer_lr"], SPARSE_DEFAULTS["outer_momentum"])
    assert tiny_run(codec="topk", outer_lr=0.5).spec.outer_lr == 0.5
    assert RunSpec("x", **codec_defaults({"codec": "topk"})).inner_steps == SPARSE_DEFAULTS["inner_steps"]
    assert RunSpec("x", **codec_defaults({"codec": "int8", "inner_steps": None})).inner_steps == 100
    dense = tiny_run(codec="int8").spec
    assert (dense.outer_lr, dense.outer_momentum) == (RunSpec("x").outer_lr, RunSpec("x").outer_momentum)


def test_a_sparse_run_with_an_outer_momentum_is_refused_with_the_reason() -> None:
    with pytest.raises(Malformed, match="topk needs outer_momentum 0"):
        RunSpec("x", codec="topk", outer_momentum=0.9)
    with pytest.raises(Malformed, match="codec must be one of"):
        RunSpec("x", codec="top-k")


def test_init_run_writes_a_sparse_run_and_says_why_it_refuses_a_momentum(tmp_path) -> None:
    runner = CliRunner()
    out, key = tmp_path / "run.spec", tmp_path / "key.pem"
    r = runner.invoke(main, ["init-run", "--name", "sparse", "--codec", "topk", "--key", str(key), "--out", str(out)])
    assert r.exit_code == 0, r.output
    spec = Genesis.load(out).spec
    assert (spec.codec, spec.outer_momentum, spec.outer_lr) == ("topk", 0.0, SPARSE_DEFAULTS["outer_lr"])
    assert spec.inner_steps == SPARSE_DEFAULTS["inner_steps"]
    r = runner.invoke(main, ["init-run", "--name", "sparse", "--codec", "topk", "--outer-momentum", "0.9",
                             "--key", str(key), "--out", str(tmp_path / "bad.spec")])
    assert r.exit_code != 0 and "needs outer_momentum 0" in r.output
    assert not (tmp_path / "bad.spec").exists()


@pytest.mark.timeout(150)
def test_learners_of_a_sparse_run_merge_audit_and_hold_bit_identical_fragments() -> None:
    genesis = tiny_run(codec="topk", replicas=1)
    learners: list[LocalLearner] = []
    try:
        learners.append(LocalLearner(genesis, 0).start())
        learners += [LocalLearner(genesis, i, peers=[learners[0].url]).start() for i in (1, 2)]
        wait_until(lambda: all(len(ll.learner.swarm.members.live()) == 3 for ll in learners), 30, "3 live members")
        first = [ll.train(10) for ll in learners]
        for _ in range(7):
            for ll in learners:
                ll.train(10)

        def settled() -> bool:
            labels = [ll.learner.labels for ll in learners]
            return all(lab == labels[0] for lab in labels) and all(v.version >= 2 for v in labels[0])

        wait_until(settled, 60, "every learner to hold the same version (>= 2) of every fragment")
        dense = get_codec("topk").dense
        for p in range(genesis.spec.fragments):
            stores = [ll.learner.swarm.store for ll in learners]
            assert len({anchor_digest(s.held[p].anchor) for s in stores}) == 1, f"fragment {p} differs"
            # the updates travelled sparse: far below the dense form of the fragment (its holders kept them)
            sizes = [len(frame) for s in stores for _, _, frame in s.held[p].updates]
            assert sizes and max(sizes) < dense.encoded_size(stores[0].numel(p)) // 2, (p, sizes)
        stats = [ll.learner.swarm.shard.stats for ll in learners]
        assert sum(s["audits_passed"] for s in stats) > 0, ("replicas recomputed the sparse merges", stats)
        assert sum(s["audits_failed"] for s in stats) == 0
        last = [ll.train(10) for ll in learners]
        assert sum(last) < sum(first), f"the loss fell: {first} -> {last}"
    finally:
        for ll in learners:
            ll.learner.close()


def test_a_topk_variant_is_named_by_its_settings_and_decoded_by_topk_itself() -> None:
    variant = get_codec("topk:1024:8:3")
    assert (variant.name, variant.chunk, variant.k, variant.bits) == ("topk", 1024, 8, 3)
    assert get_codec("topk:1024:8:3") is variant
    assert tiny_run(codec="topk:1024:8:3").spec.outer_momentum == 0.0
    x = torch.randn(3000, generator=torch.Generator().manual_seed(1))
    meta, payload = variant.encode_delta(x)
    assert torch.equal(get_codec("topk").decode(meta, payload), variant.decode(meta, payload))
    assert (torch.count_nonzero(variant.decode(meta, payload)) == 3 * 8).item()


@pytest.mark.parametrize("name", ["topk:1000:8:2", "topk:4096:0:2", "topk:4096:64:9", "topk:4096:64",
                                  "topk:٤٠٩٦:64:2", "topk:4096:64:2:1", "topk:" + "9" * 5000 + ":1:1"])
def test_a_bad_topk_variant_is_refused_in_one_line(name: str) -> None:
    with pytest.raises(Malformed, match="topk"):
        get_codec(name)
    with pytest.raises(Malformed, match="codec must be one of"):
        RunSpec("x", codec=name, outer_momentum=0.0)
