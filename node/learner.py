"""The Python API: wrap your own training loop, keep its shape (docs/architecture.md §5).

    learner = Learner(model, optimizer, Genesis.load("run.spec"), config=SwarmConfig(peers=[...]))
    learner.start()                          # joins, downloads the newest fragments into `model`
    for x, y in data:
        loss = model(x, y); loss.backward(); optimizer.step(); optimizer.zero_grad()
        learner.step(tokens=x.numel(), loss=loss.item())
    learner.close()

`step` never waits on the network: it copies newly published fragments into the model (at this step
boundary, under the store's lock), hands due fragments to the background loop, and returns. Fragment p is due
at inner steps t ≡ ⌊p·H/P⌋ (mod H).

A synchronous run (`RunSpec.synchronous`, the baseline of docs/architecture.md §10) is the one exception: there `step` waits
until fragment p's previous delta is merged before sending the next, and a checkpoint waits until every sent
delta is merged, so all learners checkpoint the same global versions (the state a rollback returns to).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch.utils.hooks import RemovableHandle

from diloco.coordinator.plan import FragmentPlan
from diloco.coordinator.runspec import Genesis, RunSpec, codec_defaults
from diloco.coordinator.version import GENESIS, Version
from diloco.coordinator.wire import anchor_bytes, anchor_digest
from diloco.protocol.codecs import load_kernels
from diloco.protocol.identity import Identity

from . import saved_momenta
from .checkpoint import capture, load_latest, restore, save_checkpoint
from .journal import Journal, open_journal
from .preempt import DrainReport
from .swarm import JoinError, Swarm, SwarmConfig, SwarmFailed
from .theta import OnWrite, Theta

log = logging.getLogger(__name__)
JOURNAL_SEGMENT = "journal_segment"  # checkpoint meta: the journal segment opened just before its capture


class RunMismatch(JoinError):
    """The local model does not match the run (different fragment plan or initial parameters)."""


class SyncTimeout(RuntimeError):
    """A synchronous run's round did not complete in time: a learner is gone; restart from the last checkpoint."""


def genesis_digest(plan: FragmentPlan, model: torch.nn.Module) -> bytes:
    """One digest of Θ^(0): every fragment's fp32 bytes, in order. Put in the RunSpec by `init-run`."""
    params = dict(model.named_parameters())
    return _digest_of([plan.flatten(p, params) for p in range(len(plan.fragments))])


def due_at(t: int, offsets: list[int], inner_steps: int) -> list[int]:
    """The fragments whose delta is due at inner step t (fragment p every H steps, at its offset)."""
    return [p for p, offset in enumerate(offsets) if t % inner_steps == offset]


def _urls(saved: object) -> list[str]:
    """The member URLs a checkpoint remembered (`Swarm.known_urls`); anything else in that field is ignored."""
    if not isinstance(saved, list):
        return []
    return [u for u in saved if isinstance(u, str) and u.startswith(("http://", "https://")) and len(u) <= 256]


def step_hook(step: Callable[..., None], tokens: int | Callable[[], int],
              loss: Callable[[], float | None] | None) -> Callable[[torch.optim.Optimizer, tuple, dict], None]:
    """An optimizer step post-hook calling `step(tokens=..., loss=...)` (what `attach` registers): `tokens` an
    int, or a function returning the tokens of the step just made; `loss` a function, or None."""
    if not callable(tokens) and (not isinstance(tokens, int) or tokens < 0):
        raise ValueError(f"tokens must be a non-negative int or a function, got {tokens!r}")
    count = tokens if callable(tokens) else (lambda: tokens)

    def after_step(_optimizer: torch.optim.Optimizer, _args: tuple, _kwargs: dict) -> None:
        step(tokens=int(count()), loss=loss() if loss is not None else None)

    return after_step


class Attached:
    """What `Learner.attach` returns: `remove()` (or leaving a `with` block) takes the optimizer hook off,
    after which the learner may be attached again."""

    def __init__(self, handle: RemovableHandle, learner: Learner) -> None:
        self._handle, self._learner = handle, learner

    def remove(self) -> None:
        self._handle.remove()
        if self._learner._attached is self._handle:
            self._learner._attached = None

    def __enter__(self) -> Attached:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _digest_of(fragments: list[torch.Tensor], anchor: Callable[[torch.Tensor], bytes] = anchor_digest) -> bytes:
    h = hashlib.sha256()
    for f in fragments:
        h.update(anchor(f))
    return h.digest()


def _sha256_anchor(fragment: torch.Tensor) -> bytes:
    """The anchor digest of the RunSpecs made before it became BLAKE3 (docs/protocol.md §7.3), only to say so."""
    return hashlib.sha256(anchor_bytes(fragment)).digest()


def create_run(creator: Identity, name: str, network: torch.nn.Module, **fields) -> Genesis:
    """A signed RunSpec (`fields` are RunSpec's) for `network`: its fragment plan and initial parameters are
    pinned in the spec, so a learner with another model or init is refused at `start()`. A sparse codec's
    outer optimizer and H, where `fields` leave them unset, are `runspec.SPARSE_DEFAULTS`."""
    spec = RunSpec(name, **codec_defaults(fields))
    plan = FragmentPlan.from_module(network, spec.fragments)
    spec = dataclasses.replace(spec, plan_digest=plan.digest(), genesis_digest=genesis_digest(plan, network))
    return Genesis.create(creator, spec)


class Learner:
    """One learner of a Decoupled DiLoCo run."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        run: Genesis | RunSpec,
        *,
        identity: Identity | None = None,
        config: SwarmConfig | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 0,
        sync_timeout_s: float = 300.0,
        params: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.spec = run.spec if isinstance(run, Genesis) else run
        load_kernels()  # before any peer is contacted: a first decode must not stall the network loop
        self.model, self.optimizer = model, optimizer
        self.identity = identity or Identity.generate()
        self.config = config or SwarmConfig()
        self.plan = FragmentPlan.from_module(model, self.spec.fragments)
        if self.spec.plan_digest and self.plan.digest() != self.spec.plan_digest:
            raise RunMismatch("this model's fragment plan differs from the run's: a different model or code "
                              "version than the run's creator used")
        # θ: the model's own parameters, or `params`, full-size tensors standing in for them (the member rank
        # of an FSDP2 learner, whose own parameters are shards: node/fsdp.py)
        self.params = dict(params) if params is not None else dict(model.named_parameters())
        self._stand_ins = params is not None
        H, P = self.spec.inner_steps, self.spec.fragments
        self.offsets = [(p * H) // P for p in range(P)]
        self.t = 0
        self.tokens = 0
        self.c_steps = [0] * P  # per fragment, the inner steps (and tokens) since its last delta
        self.c_tokens = [0] * P
        self._counts = threading.Lock()  # guards c_steps, c_tokens, sent_steps, overwritten_steps (the copier
        # thread sends its snapshots: `_submit`)
        self.sent_steps = 0  # Σ over fragments of the inner steps handed to owners inside deltas
        self.overwritten_steps = 0  # Σ over fragments of local steps discarded by a whole-fragment download
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.checkpoint_every = checkpoint_every
        self.sync_timeout_s = sync_timeout_s  # synchronous runs only: the longest wait for a merge
        self._restored: dict = {}  # counters from the checkpoint we resumed from
        # The anchors' memory, allocated and paged in with the learner (like the model and its optimizer):
        # joining then only writes into it.
        self._anchor_memory = [torch.zeros(f.numel, dtype=torch.float32) for f in self.plan.fragments]
        self._saving: threading.Thread | None = None
        self._last_step_at: float | None = None
        self.swarm: Swarm | None = None
        self._attached: RemovableHandle | None = None  # `attach`'s optimizer hook
        # told of every write into θ that `step` makes after `start` (node/theta.py OnWrite): node/distributed.py
        self.on_theta_write: OnWrite | None = None
        self._journal: Journal | None = None  # the versions accepted since the checkpoint (node/journal.py)
        # the journal segment the older kept checkpoint was captured at: segments from it on stay, so a resume
        # that falls back to that checkpoint (the newest failed its digests) still replays every version since
        self._journal_floor: int | None = None
        self.checkpoint_error: str | None = None  # why the last checkpoint write failed (a full disk), or None
        self.checkpoints_failed = 0
        self.last_checkpoint_step: int | None = None
        self.checkpoint_write_s: float | None = None  # how long the last checkpoint took to write (a drain's reserve)
        self.theta: Theta | None = None  # moves θ with new versions, copies due fragments out (node/theta.py)

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> Learner:
        """Load the local checkpoint if any, join the run, bring every fragment to its newest version."""
        labels: list[Version] = [GENESIS] * self.spec.fragments
        certs: list[bytes] = [b""] * self.spec.fragments
        ckpt = load_latest(self.checkpoint_dir) if self.checkpoint_dir else None
        fresh = ckpt is None or ckpt.meta.get("run_id") != self.spec.run_id.hex()
        if not fresh:
            restore(ckpt, self._state(), self.optimizer)
            self.t = ckpt.step
            anchors = [a.copy_(ckpt.anchors[p].reshape(-1)) for p, a in enumerate(self._anchor_memory)]
            labels = [Version(*ckpt.labels[p]) for p in range(self.spec.fragments)]
            certs = [ckpt.certs.get(p, b"") for p in range(self.spec.fragments)]
            self._restored = dict(ckpt.counters)
            self.tokens = int(self._restored.get("tokens", 0))
            self.config = dataclasses.replace(self.config, known_peers=_urls(ckpt.meta.get("peers")))
            momenta = saved_momenta.read_from(ckpt, self.spec.codec, [f.numel for f in self.plan.fragments])
            floor = ckpt.meta.get(JOURNAL_SEGMENT)
            self._journal_floor = floor if isinstance(floor, int) and not isinstance(floor, bool) else 0
            self.last_checkpoint_step = ckpt.step
            log.info("resumed from checkpoint at step %d", self.t)
        else:
            momenta = {}
        unset: list[int] = []
        if fresh and self.config.peers:  # joining: the fragments are downloaded straight into the anchors;
            # those nobody has a version of yet get our Θ^(0) once synced (`_fill_unset`)
            anchors = self._anchor_memory
            unset = list(range(self.spec.fragments))
        elif fresh:  # opening a swarm: from our Θ^(0)
            anchors = [self.plan.flatten(p, self.params, out=a) for p, a in enumerate(self._anchor_memory)]
            if self.spec.genesis_digest:
                self._check_genesis(anchors)
        self._anchor_memory = []  # the store's from now on
        # the versions accepted after that checkpoint, replayed: this learner holds again, and offers to the
        # owners, the newest version it accepted before it stopped (docs/architecture.md §5.6)
        self._journal = open_journal(self.checkpoint_dir, self.spec, anchors, labels, certs, resumed=not fresh,
                                     into_theta=lambda p, anchor: self.plan.unflatten_into(p, anchor, self.params),
                                     momenta=momenta)
        self.swarm = Swarm(self.identity, self.spec, self.plan, anchors, self.config, labels, certs,
                           adopt_anchors=True, unset=unset, journal=self._journal, momenta=momenta)
        self.swarm.extra_status.append(self._storage_status)
        self.swarm.store.merged_steps = int(self._restored.get("merged_steps", 0))
        self.swarm.store.merged_tokens = int(self._restored.get("merged_tokens", 0))
        self.swarm.progress.step, self.swarm.progress.tokens = self.t, self.tokens  # (a resume: not 0 until its first step)
        self.theta = Theta(self.swarm.store, self.plan, self.params, self.swarm.pool, self._submit,
                           self._overwritten, background=not self.spec.synchronous, on_write=self.on_theta_write)
        if unset:
            self.swarm.after_sync = self._fill_unset
            # (a fragment whose owner keeps every update since 0.0 is built from our Θ^(0) and those: the model
            # is read by the swarm's threads only while `start` waits for the join, before any step)
            self.swarm.genesis = lambda p, out: self.plan.flatten(p, self.params, out=out)
        self.swarm.start()
        self._apply_new_versions()
        self.swarm.offer_ownership()
        if self.spec.synchronous:
            self._rendezvous()
            self._apply_new_versions()
        return self

    def _fill_unset(self) -> None:
        """Joining, once synced: fragments nobody has a version of yet start from our initial values, so only
        then must those be the run's (a model whose every fragment is downloaded may start from anything).
        The model still holds them here: versions reach it after `start`."""
        store = self.swarm.store
        self.swarm.sync.genesis = None  # (the model moves from now on)
        if not store.unset:
            return
        values = {p: self.plan.flatten(p, self.params)
                  for p in (range(self.spec.fragments) if self.spec.genesis_digest else sorted(store.unset))}
        if self.spec.genesis_digest:
            self._check_genesis(list(values.values()))
        for p in sorted(store.unset):
            store.fill(p, values[p])

    def _check_genesis(self, anchors: list[torch.Tensor]) -> None:
        if _digest_of(anchors) == self.spec.genesis_digest:
            return
        if _digest_of(anchors, _sha256_anchor) == self.spec.genesis_digest:
            raise RunMismatch("this RunSpec was made by an older diloco-node, whose anchor digests were SHA-256 "
                              "(docs/protocol.md §7.3): its peers and this one cannot check each other's "
                              "fragments; make the run again with `diloco-node init-run`")
        raise RunMismatch("this model's initial parameters differ from the run's; build it with the "
                          f"run's seed ({self.spec.seed}) and task ({self.spec.task})")

    def _rendezvous(self) -> None:
        """Synchronous runs start like data parallel: once every learner of the quorum is in the swarm (a delta
        sent earlier could go to an owner that hands its fragment over as the others arrive, and be lost)."""
        deadline = time.monotonic() + self.sync_timeout_s
        while len(self.swarm.members.live()) < self.spec.quorum:
            if time.monotonic() > deadline:
                raise SyncTimeout(f"only {len(self.swarm.members.live())} of the {self.spec.quorum} learners of "
                                  f"this synchronous run joined within {self.sync_timeout_s:.0f} s")
            time.sleep(0.05)
        time.sleep(2 * self.config.member_poll_s)  # and let every other member's view of the swarm settle too

    def close(self, checkpoint: bool = True) -> None:
        """Stop: a last checkpoint (unless `checkpoint` is False: a drain wrote it), then the swarm."""
        if checkpoint and self.checkpoint_dir is not None and self.swarm is not None:
            self.save_checkpoint(wait=True)
        if self.swarm is not None:
            self.swarm.stop()
        if self.theta is not None:
            self.theta.close()

    def drain(self, deadline: float, reason: str = "") -> DrainReport:
        """Leave the swarm cleanly by `deadline` (time.monotonic()), between two steps, never to step again:
        every fragment's unsent steps go out as deltas now, the swarm hands over what it owns and marks its
        record `left` (`Swarm.drain`), and a final checkpoint is written (docs/preemption.md). Then call
        `close(checkpoint=False)`. What the deadline cut short is in the report's `skipped`."""
        t0 = time.monotonic()
        with self._counts:
            unsent = [p for p in range(self.spec.fragments) if self.c_steps[p] > 0]
        for p in unsent:
            self.theta.due(p)
        self.theta.send_due()
        total = max(0.0, deadline - t0)
        write_s = self.checkpoint_write_s if self.checkpoint_write_s is not None else 1.0
        reserve = min(0.25 * total, 1.0 + 2 * write_s if self.checkpoint_dir is not None else 0.5)
        report = self.swarm.drain(deadline - reserve)
        report.reason, report.deltas_flushed = reason, len(unsent)
        if self.checkpoint_dir is not None:
            report.checkpoint = False
            # (a synchronous run's checkpoint waits for every sent delta's merge: no longer than the deadline)
            waits, self.sync_timeout_s = self.sync_timeout_s, max(0.1, deadline - time.monotonic())
            try:
                if time.monotonic() < deadline:
                    self.save_checkpoint(wait=True)
                    report.checkpoint = self.checkpoint_error is None and self.last_checkpoint_step == self.t
            except SyncTimeout:
                pass
            finally:
                self.sync_timeout_s = waits
            if not report.checkpoint:
                report.skipped.append(f"the final checkpoint ({self.checkpoint_error or 'no time left'})")
            report.checkpoint_step = self.last_checkpoint_step
        report.seconds = round(time.monotonic() - t0, 3)
        return report

    def __enter__(self) -> Learner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the training-loop hook -----------------------------------------------------------------------------

    def attach(self, optimizer: torch.optim.Optimizer | None = None, *,
               tokens: int | Callable[[], int], loss: Callable[[], float | None] | None = None) -> Attached:
        """Call `step` after every `optimizer.step()` (a step post-hook, as torchft does): the training loop
        stays as it was. `tokens`: the tokens of one inner step (an int), or a function returning those of the
        step just made; `loss`: a function returning its loss, for status and logs. The default optimizer is
        the learner's own. Returns an `Attached` (its `remove()` takes the hook off). An error of the swarm
        (`SwarmFailed`) is raised from `optimizer.step()`."""
        optimizer = optimizer if optimizer is not None else self.optimizer
        if self._attached is not None:
            raise RuntimeError("this learner is already attached to an optimizer; remove that hook first")
        handle = optimizer.register_step_post_hook(step_hook(self.step, tokens, loss))
        self._attached = handle
        return Attached(handle, self)

    def step(self, tokens: int, loss: float | None = None) -> None:
        """Call once after every inner `optimizer.step()`. Never blocks on the network (a synchronous run
        waits for merges: see the module docstring)."""
        if self.swarm is None:
            raise RuntimeError("call Learner.start() before step()")
        if not self.swarm.healthy:
            raise self.swarm.error or SwarmFailed("the swarm loop is not running (stopped, or it died before "
                                                  "reporting why); restart this learner")
        if not 0 <= tokens <= self.spec.max_tokens_per_step:
            raise ValueError(f"tokens={tokens} for one inner step; this run takes 0 to {self.spec.max_tokens_per_step} "
                             "(the RunSpec's max_tokens_per_step: owners refuse deltas that claim more)")
        now = time.monotonic()
        self.t += 1
        self.tokens += tokens
        with self._counts:
            for p in range(self.spec.fragments):
                self.c_steps[p] += 1
                self.c_tokens[p] += tokens
        for p in due_at(self.t, self.offsets, self.spec.inner_steps):
            if self.spec.synchronous:
                self._wait_merged([p])
            if self.c_steps[p] > 0:
                self.theta.due(p)
        self.theta.step()
        pr = self.swarm.progress
        if self._last_step_at is not None:
            dt = now - self._last_step_at
            pr.step_time_s = dt if pr.step_time_s == 0 else 0.9 * pr.step_time_s + 0.1 * dt
            pr.tokens_per_s = tokens / pr.step_time_s if pr.step_time_s > 0 else 0.0
            self.theta.step_time_s = pr.step_time_s
        self._last_step_at = now
        pr.step, pr.tokens = self.t, self.tokens
        if loss is not None:
            pr.loss = float(loss)
        if self.checkpoint_every and self.t % self.checkpoint_every == 0:
            self.save_checkpoint()

    def _wait_merged(self, fragments: list[int] | range) -> None:
        """Synchronous runs: block until these fragments' sent deltas are merged, then apply the versions."""
        if not self.swarm.store.wait_settled(fragments, self.sync_timeout_s):
            raise SyncTimeout(f"a synchronous round of fragments {list(fragments)} did not complete in "
                              f"{self.sync_timeout_s:.0f} s: a learner is missing; restart every learner from "
                              "its last checkpoint")
        self._apply_new_versions()

    def _apply_new_versions(self) -> None:
        """Move θ with every version the store has now, at once (the rebase rule, `coordinator.rebase`):
        θ[p] += U, plus our own delta once merged; a fragment downloaded whole overwrites θ[p]. `step` does
        the same a slice per step (node/theta.py)."""
        self.theta.flush()

    @property
    def base(self) -> list[Version]:
        """Per fragment, the version θ[p] is based on."""
        return self.theta.base if self.theta is not None else []

    def _submit(self, p: int, snapshot: torch.Tensor, base: Version) -> None:
        """A due fragment's snapshot is complete: its delta goes out with the steps made since the last one
        (called on the training thread, or on Theta's copier thread)."""
        with self._counts:
            steps, tokens = self.c_steps[p], self.c_tokens[p]
            self.c_steps[p] = self.c_tokens[p] = 0
            self.sent_steps += steps
        if steps == 0:  # θ[p] was overwritten since it was due: nothing of ours to send
            self.swarm.pool.give(snapshot)
            return
        if self.spec.synchronous:  # what `_wait_merged` waits for
            self.swarm.store.begin_send(p)
        self.swarm.submit_delta(p, snapshot, base, steps, tokens)

    def _overwritten(self, p: int) -> None:
        """θ[p] was replaced by a whole download: the local steps it held are gone."""
        with self._counts:
            self.overwritten_steps += self.c_steps[p]
            self.c_steps[p] = self.c_tokens[p] = 0

    # -- checkpoints ----------------------------------------------------------------------------------------

    def save_checkpoint(self, wait: bool = False) -> None:
        """Capture now (at this step boundary), write in a background thread; skipped if one is still writing."""
        if self.checkpoint_dir is None or self.swarm is None:
            return
        if self._saving is not None and self._saving.is_alive():
            if not wait:
                return
            self._saving.join()
        if self.spec.synchronous:  # the barrier: every learner checkpoints the same global versions
            self._wait_merged(range(self.spec.fragments))
        # a new journal segment first: the older ones then hold only versions this capture includes
        segment = self._journal.rotate() if self._journal is not None else None
        store = self.swarm.store

        def read(held: list) -> tuple[dict, dict, dict, dict]:  # with the store's lock held
            return ({p: h.anchor.clone() for p, h in enumerate(held)},
                    {p: (h.label.term, h.label.version) for p, h in enumerate(held)},
                    {p: h.cert for p, h in enumerate(held)},
                    {"merged_steps": store.merged_steps, "merged_tokens": store.merged_tokens, "tokens": self.tokens})

        # θ gets every change taken together with the anchors: θ and the anchors it is based on agree
        anchors, labels, certs, counters = self.theta.flush(also=read)
        ckpt = capture(self._state(), self.optimizer, step=self.t, anchors=anchors, labels=labels, certs=certs,
                       counters=counters,
                       meta={"run_id": self.spec.run_id.hex(), "peer_id": self.identity.peer_id,
                             "wall_time": time.time(), "peers": self.swarm.known_urls(),
                             **({JOURNAL_SEGMENT: segment} if segment is not None else {})})

        def write() -> None:
            started = time.monotonic()
            try:
                # the momenta of the versions this peer holds now (their labels say which): read on the loop
                saved_momenta.add_to(ckpt, self.swarm.held_momenta())
                save_checkpoint(self.checkpoint_dir, ckpt)
            except Exception as e:  # a full disk: the older checkpoints and the journal still stand; train on
                self.checkpoints_failed += 1
                self.checkpoint_error = f"checkpoint at step {ckpt.step} not written: {type(e).__name__}: {e}"
                log.error("%s; training goes on, the last good checkpoint and the journal are kept",
                          self.checkpoint_error)
                return
            self.checkpoint_error, self.last_checkpoint_step = None, ckpt.step
            self.checkpoint_write_s = time.monotonic() - started
            if segment is not None:  # on disk now: what only the checkpoint before it needed can go
                self._journal.drop_before(segment if self._journal_floor is None else self._journal_floor)
                self._journal_floor = segment

        self._saving = threading.Thread(target=write, daemon=True)
        self._saving.start()
        if wait:
            self._saving.join()

    def _storage_status(self) -> dict:
        """The `storage` object of `/v1/status` (docs/status.md): a failing disk shows there, not only in the log."""
        return {"storage": {"checkpoint_error": self.checkpoint_error, "checkpoints_failed": self.checkpoints_failed,
                            "last_checkpoint_step": self.last_checkpoint_step,
                            "journal_write_failures": self._journal.failed_writes if self._journal else 0}}

    def _state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds of the model: its state_dict, with θ's tensors in place of its parameters."""
        if not self._stand_ins:
            return self.model.state_dict()
        name_of = {id(t): n for n, t in self.model.named_parameters()}  # (a tied parameter has several keys)
        return {k: self.params[name_of[id(v)]] if id(v) in name_of else v.detach()
                for k, v in self.model.state_dict(keep_vars=True).items()}

    # -- views ----------------------------------------------------------------------------------------------

    def global_model(self) -> torch.nn.Module:
        """A copy of the model with every fragment at the version this learner holds (its anchors: the newest
        published version of each fragment it has), without the local steps not merged yet: the model to ship
        or evaluate. The live model is not touched."""
        if self.swarm is None:
            raise RuntimeError("call Learner.start() before global_model()")
        if self._stand_ins:
            raise RuntimeError("global_model() copies the model's own parameters; this learner's are shards "
                               "(FSDP2): read the anchors from learner.swarm.store instead")
        store = self.swarm.store
        if store.unset:
            raise RuntimeError(f"fragments {sorted(store.unset)} have no version here yet (still joining)")
        model = copy.deepcopy(self.model)
        params = dict(model.named_parameters())
        for p in range(self.spec.fragments):
            anchor, _label, _cert = store.snapshot(p)
            self.plan.unflatten_into(p, anchor, params)
        return model

    @property
    def labels(self) -> list[Version]:
        return self.swarm.store.labels() if self.swarm else []

    def status(self) -> dict:
        return self.swarm.status() if self.swarm else {}

    @property
    def healthy(self) -> bool:
        """True while the learner trains with the swarm: started, and its background loop is running."""
        return self.swarm is not None and self.swarm.healthy

    @property
    def error(self) -> SwarmFailed | None:
        """Why the background loop died after the join (what the next `step` raises), or None."""
        return self.swarm.error if self.swarm else None
