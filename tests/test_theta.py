"""θ's half of the rebase rule a slice per step (node/theta.py): the same θ as applying everything at once,
never more than one slice of work per step when the budget is spent, and a snapshot copied across steps that
still gives the exact delta."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from diloco.coordinator.buffers import BufferPool
from diloco.coordinator.fragments import Encoded, FragmentStore
from diloco.coordinator.plan import FragmentPlan
from diloco.coordinator.version import GENESIS, Version
from diloco.node import theta as theta_mod
from diloco.node.swarm import SwarmFailed
from diloco.node.theta import Theta
from diloco.protocol.codecs import get_codec

N = 40  # elements per fragment: 5 slices of 8


@pytest.fixture
def one_slice_per_step(monkeypatch):
    """No budget beyond the one slice each step always does, of 8 elements: the work per step is countable."""
    monkeypatch.setattr(theta_mod, "SLICE", 8)
    monkeypatch.setattr(theta_mod, "BUDGET_SHARE", 0.0)
    monkeypatch.setattr(theta_mod, "MIN_BUDGET_S", 0.0)


class Rig:
    """A model of two fragments (one 5×8 matrix each), its store, and a Theta that records what it sends
    (copying due fragments a slice per step unless `copy_in_background`)."""

    def __init__(self, background: bool = True, copy_in_background: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.params = {"a": torch.randn(5, 8, generator=g), "b": torch.randn(5, 8, generator=g)}
        self.plan = FragmentPlan.from_shapes([("a", (5, 8), False), ("b", (5, 8), False)], 2)
        self.p = self.plan.fragment_of("a")
        self.store = FragmentStore([self.plan.flatten(q, self.params) for q in range(2)], "me")
        self.pool = BufferPool(N)
        self.sent: list[tuple[int, torch.Tensor, Version]] = []
        self.replaced: list[int] = []
        self.theta = Theta(self.store, self.plan, self.params, self.pool,
                           lambda p, buf, base: self.sent.append((p, buf.clone(), base)), self.replaced.append,
                           background=background, copy_in_background=copy_in_background)

    def wait_sent(self, n: int) -> None:
        """Wait until `n` snapshots have gone out (the copier sends its own, on its thread)."""
        deadline = time.monotonic() + 5
        while len(self.sent) < n:
            assert time.monotonic() < deadline, f"{len(self.sent)} snapshots sent, not {n}"
            time.sleep(0.005)

    def theta_of(self, p: int) -> torch.Tensor:
        return self.plan.flatten(p, self.params)

    def summed(self) -> None:
        """Wait until the summer thread has summed everything queued."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with self.theta._cond:
                if not self.theta._queue and self.theta._summing is None:
                    return
            time.sleep(0.005)
        raise AssertionError("the summer did not finish")


def int8(t: torch.Tensor) -> Encoded:
    codec = get_codec("int8")
    meta, payload = codec.encode(t)
    return Encoded(codec, meta, payload)


def test_a_version_is_added_a_slice_per_step_and_theta_ends_where_adding_it_at_once_would(one_slice_per_step):
    rig = Rig()
    p = rig.p
    before = rig.theta_of(p)
    u = torch.randn(N)
    move = int8(u)
    rig.store.advance(p, GENESIS, Version(1, 1), u, b"f", b"c", move=move)
    rig.theta.step()  # takes the move; the summer sums it meanwhile
    rig.summed()
    labels = []
    for _ in range(5):
        rig.theta.step()
        labels.append(rig.theta.base[p])
    expected = before + move.decode(N)
    assert torch.equal(rig.theta_of(p), expected)
    assert labels == [GENESIS] * 4 + [Version(1, 1)], "θ[p] is based on the new version only once all of it is in"


def test_each_step_adds_one_slice_when_the_budget_is_spent(one_slice_per_step):
    rig = Rig()
    p = rig.p
    before = rig.theta_of(p)
    u = torch.ones(N)
    rig.store.advance(p, GENESIS, Version(1, 1), u, b"f", b"c")
    rig.theta.step()
    rig.summed()
    for k in range(1, 6):
        rig.theta.step()
        moved = (rig.theta_of(p) - before) != 0
        assert int(moved.sum()) == 8 * k, f"after {k} steps, {int(moved.sum())} elements moved"


def test_versions_arriving_while_one_is_being_added_all_reach_theta_once(one_slice_per_step):
    rig = Rig()
    p = rig.p
    before = rig.theta_of(p)
    updates = [torch.randn(N) for _ in range(4)]
    label = GENESIS
    for i, u in enumerate(updates):
        new = Version(1, i + 1)
        rig.store.advance(p, label, new, u, b"f", b"c")
        label = new
        rig.theta.step()
        rig.theta.step()  # two slices of the sum in hand, then the next version lands
    rig.theta.flush()
    assert torch.allclose(rig.theta_of(p), before + sum(updates), atol=1e-6)
    assert rig.theta.base[p] == label


def test_a_snapshot_copied_over_several_steps_gives_the_exact_delta_and_its_moves_wait(one_slice_per_step):
    rig = Rig()
    p = rig.p
    anchor = rig.store.held[p].anchor.clone()
    rig.theta.due(p)
    copied_at: list[torch.Tensor] = []
    for step in range(5):
        rig.theta.step()
        copied_at.append(rig.theta_of(p).clone())  # θ as it was when this step's slice was copied
        if step == 1:  # a version lands mid-copy: it must wait until the copy is done
            rig.store.advance(p, GENESIS, Version(1, 1), torch.full((N,), 100.0), b"f", b"c")
        with torch.no_grad():  # an inner step moves every element of θ
            rig.params["a"].add_(0.01)
    assert len(rig.sent) == 1
    sent_p, snapshot, base = rig.sent[0]
    assert sent_p == p and base == GENESIS
    for k in range(5):  # element i is θ_i as of the step its slice was copied in
        assert torch.equal(snapshot[8 * k : 8 * (k + 1)], copied_at[k][8 * k : 8 * (k + 1)])
    assert (snapshot < 50).all(), "the version that landed mid-copy reached θ before the copy was done"
    delta = anchor - snapshot  # Δ_i = Θ_base,i − θ_i; after the merge θ keeps what came after each copy
    assert delta.shape == (N,)
    rig.summed()
    rig.theta.flush()
    assert (rig.theta_of(p) > 50).all(), "the waiting version reached θ once the copy was done"


def test_a_due_fragment_waits_for_its_moves_at_most_max_defer_steps(one_slice_per_step, monkeypatch):
    rig = Rig()
    p = rig.p
    sum_into = rig.theta._sum_into

    def slow(*args, **kwargs):  # a summer far behind: the due fragment must not wait for it for ever
        time.sleep(1.0)
        sum_into(*args, **kwargs)

    monkeypatch.setattr(rig.theta, "_sum_into", slow)
    rig.store.advance(p, GENESIS, Version(1, 1), torch.ones(N), b"f", b"c")
    rig.theta.due(p)
    t0 = time.monotonic()
    for _ in range(theta_mod.MAX_DEFER):  # the first takes the move; each is a step of waiting
        rig.theta.step()
    assert time.monotonic() - t0 < 0.9 and not rig.sent and not rig.theta._snaps, "it did not wait"
    rig.theta.step()  # now the moves are applied at once (waiting for the summer), and the copy begins
    assert p in rig.theta._snaps and rig.theta.base[p] == Version(1, 1)
    for _ in range(4):
        rig.theta.step()
    assert len(rig.sent) == 1 and rig.sent[0][2] == Version(1, 1), "built on the new version"


def test_a_fragment_downloaded_whole_mid_copy_is_copied_again_and_said_overwritten(one_slice_per_step):
    rig = Rig()
    p = rig.p
    rig.theta.due(p)
    rig.theta.step()
    rig.theta.step()
    installed = torch.full((N,), 3.0)
    rig.store.install(p, installed, Version(2, 5), b"cert")
    for _ in range(6):
        rig.theta.step()
    assert rig.replaced == [p]
    assert len(rig.sent) == 1
    _, snapshot, base = rig.sent[0]
    assert base == Version(2, 5) and torch.equal(snapshot, installed)


def test_a_move_that_cannot_be_decoded_is_reported_at_the_next_step():
    rig = Rig()
    p = rig.p
    codec = get_codec("int8")
    meta, payload = codec.encode(torch.ones(2 * N))  # twice the elements the fragment has
    rig.store.advance(p, GENESIS, Version(1, 1), torch.ones(N), b"f", b"c", move=Encoded(codec, meta, payload))
    rig.theta.step()
    rig.summed()
    with pytest.raises(SwarmFailed, match="decoding"):
        rig.theta.step()


def test_a_checkpoint_read_inside_flush_matches_theta():
    rig = Rig()
    p = rig.p
    before = rig.theta_of(p)
    u = torch.randn(N)
    rig.store.advance(p, GENESIS, Version(1, 1), u, b"f", b"c")
    anchors, labels = rig.theta.flush(also=lambda held: ([h.anchor.clone() for h in held], [h.label for h in held]))
    assert labels[p] == Version(1, 1) and rig.theta.base[p] == Version(1, 1)
    assert torch.equal(anchors[p], before + u) and torch.equal(rig.theta_of(p), before + u)


def test_without_the_summer_everything_happens_in_the_same_step():
    rig = Rig(background=False)
    p = rig.p
    before = rig.theta_of(p)
    rig.store.advance(p, GENESIS, Version(1, 1), torch.ones(N), b"f", b"c")
    rig.theta.due(p)
    rig.theta.step()
    assert torch.equal(rig.theta_of(p), before + 1) and rig.sent[0][2] == Version(1, 1)


def test_a_step_does_not_wait_while_the_loop_holds_the_store_lock(one_slice_per_step):
    rig = Rig()
    p = rig.p
    rig.store.advance(p, GENESIS, Version(1, 1), torch.ones(N), b"f", b"c")
    with rig.store.lock:  # the event loop writing an anchor
        t0 = time.monotonic()
        for _ in range(theta_mod.MAX_SKIPS):
            rig.theta.step()
        assert time.monotonic() - t0 < 0.5 and rig.theta.base[p] == GENESIS
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (rig.theta.step(), done.set()))
        waiter.start()  # after MAX_SKIPS steps in a row, the next one waits for the lock
        assert not done.wait(0.3)
    waiter.join(5)
    assert done.is_set()
    rig.theta.flush()
    assert rig.theta.base[p] == Version(1, 1)


class Gate:
    """Holds the copier thread before each slice it copies until the test lets it (`let`), so that what the
    training thread does between two slices is chosen, not raced."""

    def __init__(self, rig: Rig) -> None:
        self.allowed, self.copied = threading.Semaphore(0), threading.Semaphore(0)
        copy_range = rig.plan.copy_range

        def gated(*args, **kwargs):
            if threading.current_thread().name == "diloco-theta-copy":
                assert self.allowed.acquire(timeout=5), "the test did not let the copier on"
                try:
                    return copy_range(*args, **kwargs)
                finally:
                    self.copied.release()
            return copy_range(*args, **kwargs)

        rig.plan.copy_range = gated

    def let(self, slices: int = 1) -> None:
        for _ in range(slices):
            self.allowed.release()
            assert self.copied.acquire(timeout=5), "the copier did not copy its slice"


def test_the_copier_copies_a_due_fragment_while_theta_moves_and_its_moves_wait_until_it_is_done(one_slice_per_step):
    rig = Rig(copy_in_background=True)
    gate = Gate(rig)
    p = rig.p
    anchor = rig.store.held[p].anchor.clone()
    rig.theta.due(p)
    rig.theta.step()  # the snapshot starts: the copier takes it
    seen: list[torch.Tensor] = []
    for k in range(5):
        gate.let()  # slice k copied now, while the training thread is between two steps
        seen.append(rig.theta_of(p).clone())
        if k == 1:  # a version lands mid-copy: θ[p] must not move with it until the copy is done
            rig.store.advance(p, GENESIS, Version(1, 1), torch.full((N,), 100.0), b"f", b"c")
        with torch.no_grad():  # an inner step moves every element of θ
            rig.params["a"].add_(0.01)
        if k < 4:
            rig.theta.step()
            assert not rig.sent and (rig.theta_of(p) < 50).all(), "sent early, or a move reached θ mid-copy"
    rig.wait_sent(1)  # the copier sends it itself: no step boundary needed
    rig.theta.step()
    assert len(rig.sent) == 1
    sent_p, snapshot, base = rig.sent[0]
    assert sent_p == p and base == GENESIS
    for k in range(5):  # element i is θ_i as it was when the copier read it
        assert torch.equal(snapshot[8 * k : 8 * (k + 1)], seen[k][8 * k : 8 * (k + 1)])
    assert (anchor - snapshot).shape == (N,)
    rig.summed()
    rig.theta.flush()
    assert (rig.theta_of(p) > 50).all(), "the waiting version reached θ once the copy was done"
    rig.theta.close()


def test_the_copier_sends_a_snapshot_it_has_copied_while_the_training_loop_does_not_step(one_slice_per_step):
    """A loop that stops stepping after a fragment fell due (an evaluation, a data loader that stalls) must not
    hold that delta back: the copier sends the snapshot as soon as it is complete."""
    rig = Rig(copy_in_background=True)
    p = rig.p
    expected = rig.theta_of(p).clone()
    rig.theta.due(p)
    rig.theta.step()  # the copier takes it; no step follows
    rig.wait_sent(1)
    sent_p, snapshot, base = rig.sent[0]
    assert sent_p == p and base == GENESIS and torch.equal(snapshot, expected)
    with rig.theta._cond:
        assert p not in rig.theta._snaps, "a sent snapshot is no longer the training thread's to send"
    rig.theta.step()
    assert len(rig.sent) == 1, "sent once, not again at the next step"
    rig.theta.close()


def download_while_copying(slices: int) -> tuple[Rig, Gate, torch.Tensor]:
    """A due fragment whose copier has copied `slices` slices when a whole download of it lands in the store
    (not yet taken by the training thread)."""
    rig = Rig(copy_in_background=True)
    gate = Gate(rig)
    rig.theta.due(rig.p)
    rig.theta.step()
    gate.let(slices)
    installed = torch.full((N,), 3.0)
    rig.store.install(rig.p, installed, Version(2, 5), b"cert")
    return rig, gate, installed


def test_a_fragment_downloaded_whole_while_the_copier_copies_it_is_copied_again_and_no_buffer_is_lost(
        one_slice_per_step):
    rig, gate, installed = download_while_copying(2)
    p = rig.p
    rig.theta.step()  # θ[p] overwritten: the copy in flight is cancelled and the fragment is due again
    assert rig.replaced == [p]
    gate.let(1 + 5)  # the cancelled copy stops after the slice it was waiting to copy; then the new one runs
    rig.theta.flush()  # waits for the copier
    assert len(rig.sent) == 1
    _, snapshot, base = rig.sent[0]
    assert base == Version(2, 5) and torch.equal(snapshot, installed)
    lent = [ref for ref, _ in rig.pool._lent.values() if ref() is not None]
    assert len(lent) == 1, f"{len(lent)} buffers still lent: only the snapshot sent should be"
    rig.theta.close()


def test_a_copy_that_a_whole_download_overwrites_midway_is_never_sent(one_slice_per_step):
    """The copier's last slice runs while θ[p] is being overwritten by a download: that snapshot holds old and
    new values (torn); it must be dropped, and the fragment copied afresh."""
    rig, gate, installed = download_while_copying(4)
    p = rig.p
    unflatten = rig.plan.unflatten_into

    def overwrite_then_copy_the_last_slice(q, anchor, params):
        unflatten(q, anchor, params)
        gate.let()  # slice 4 is copied from the new values, slices 0-3 were the old ones
        time.sleep(0.1)  # (room for the copier to send it, were it to)

    rig.plan.unflatten_into = overwrite_then_copy_the_last_slice
    rig.theta.step()
    rig.plan.unflatten_into = unflatten
    assert not rig.sent, "a torn snapshot went out"
    assert rig.replaced == [p]
    rig.theta.step()  # due again: a fresh copy
    gate.let(5)
    rig.wait_sent(1)
    _, snapshot, base = rig.sent[0]
    assert base == Version(2, 5) and torch.equal(snapshot, installed)
    rig.theta.close()


def test_a_copy_that_fails_is_reported_at_the_next_step(one_slice_per_step):
    rig = Rig(copy_in_background=True)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    rig.plan.copy_range = broken
    rig.theta.due(rig.p)
    rig.theta.step()
    with pytest.raises(SwarmFailed, match="copying a due fragment out of the model failed .*device lost"):
        rig.theta.flush()
    rig.theta.close()

