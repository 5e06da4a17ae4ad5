"""What an operator watches: a short history of this peer's progress, and the alerts its own view can raise
(docs/status.md "History and alerts").

The `Observer` is owned by the `Swarm` and fed a `Reading` (a few numbers copied off the swarm's state) once
a second by a task on the swarm's loop; every `HISTORY_EVERY_S` it keeps a sample, at most `HISTORY_KEPT`.
`/v1/status` then only copies what is kept, so a dashboard polling every 2 s costs no more than a read. The
alert rules and the goodput and staleness figures are pure functions of their inputs: no clock, no network.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from diloco.coordinator.version import Version
from diloco.protocol.errors import Malformed

if TYPE_CHECKING:
    from diloco.protocol.transport import RouteCounter

    from .swarm import Swarm

log = logging.getLogger(__name__)

TICK_S = 1.0  # how often the observer reads the swarm (version moves are timed to this)
HISTORY_EVERY_S = 5.0  # one history sample this often
HISTORY_KEPT = 720  # samples kept: an hour at 5 s
STALL_ROUNDS = 5  # a fragment with no new version for this many expected rounds is stalled

WARNING, ERROR = "warning", "error"
PEER_SILENT, FRAGMENT_STALLED = "peer_silent", "fragment_stalled"
NONFINITE_LOSS, STALENESS = "nonfinite_loss", "staleness"
ALERT_KINDS = (PEER_SILENT, FRAGMENT_STALLED, NONFINITE_LOSS, STALENESS)


@dataclass(frozen=True)
class Alert:
    kind: str
    severity: str
    message: str
    since: float | None = None  # unix seconds; None: since it was first raised (`AlertBook`)
    peer_id: str | None = None
    fragment: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Reading:
    """The swarm's state at one moment, as the rules need it (`read`)."""

    t: float  # unix seconds
    step: int
    tokens: int
    loss: float | None
    eval_loss: float | None
    tokens_per_s: float
    step_time_s: float  # the median inner step time of the live members that measured one (0: none did)
    labels: list[Version]  # the version of each fragment this peer holds
    newest: list[Version]  # the newest version of each fragment this peer knows of (`newest_versions`)
    peers: int  # live members, this peer included
    merged_steps: int  # the store's counter of this learner's fragment-steps merged into versions
    delta_sent: bool  # this learner has tried to send a delta
    traffic: dict[str, dict[str, int]] = field(default_factory=dict)  # `traffic`
    heard: dict[str, float] = field(default_factory=dict)  # `Membership.heard`
    recorded: frozenset[str] = frozenset()  # peers whose member record has not expired
    me: str = ""


# -- pure figures -----------------------------------------------------------------------------------------

_NUMBER = re.compile(r"/\d+(?=/|$)")


def route_of(path: str) -> str:
    """The route pattern of a requested path: `/v1/updates/3?after=1.2` -> `/v1/updates/{p}`."""
    return _NUMBER.sub("/{p}", path.partition("?")[0])


def traffic(served: Mapping[str, RouteCounter],
            sent: Mapping[str, RouteCounter]) -> dict[str, dict[str, int]]:
    """Cumulative bytes per route pattern, both sides together: `in` = what reached this peer (request bodies
    it served, answers it received), `out` = what it sent (answers it served, request bodies it sent)."""
    out: dict[str, dict[str, int]] = {}
    for table in (served, sent):
        for path, c in list(table.items()):
            row = out.setdefault(route_of(path), {"in": 0, "out": 0})
            row["in"] += c.bytes_in
            row["out"] += c.bytes_out
    return out


def finite(x: float | None) -> float | None:
    """`x`, or None when it is missing or not finite (JSON has no NaN)."""
    return x if x is not None and math.isfinite(x) else None


def goodput(merged_steps: int, step: int, fragments: int, first: tuple[int, int] | None,
            delta_sent: bool) -> float | None:
    """The share of the inner steps since `first` = (step, merged_steps) whose progress an accepted version
    names as merged: Δmerged fragment-steps / (P · Δsteps), at most 1; None before a delta was sent."""
    if first is None or not delta_sent or step <= first[0]:
        return None
    return max(0.0, min(1.0, (merged_steps - first[1]) / (fragments * (step - first[0]))))


def staleness(newest: Version, held: Version) -> int:
    """Versions between the newest version known and the one held (0 when held is the newest)."""
    return max(0, newest.version - held.version)


def newest_versions(labels: list[Version], reported: Iterable[list[Version]],
                    announced: Iterable[Version | None]) -> list[Version]:
    """Per fragment, the highest of: the version held, every member's report, the DHT's announcement."""
    newest = list(labels)
    for versions in (*reported, list(announced)):
        for p, v in enumerate(versions[: len(newest)]):
            if v is not None and v > newest[p]:
                newest[p] = v
    return newest


def delta_sent(sync_stats: Mapping[str, int]) -> bool:
    """Whether this learner has tried to send a delta (the sync's counters: sent, refused or lost)."""
    return any(k == "deltas_sent" or k.startswith(("deltas_refused_", "deltas_lost")) for k in sync_stats)


def median_step_time(step_times: Iterable[float]) -> float:
    measured = [s for s in step_times if s > 0 and math.isfinite(s)]
    return statistics.median(measured) if measured else 0.0


# -- alert rules (pure) -----------------------------------------------------------------------------------

def silent_peers(heard: Mapping[str, float], recorded: Iterable[str], me: str, ttl_s: float,
                 now: float) -> list[Alert]:
    """`peer_silent`: a member heard from before, whose record expired without saying `left`."""
    present = set(recorded)
    return [Alert(PEER_SILENT, WARNING, f"member {peer[:8]} not heard from for {now - at:.0f}s (member TTL "
                  f"{ttl_s:g}s) and did not leave", since=at + ttl_s, peer_id=peer)
            for peer, at in sorted(heard.items())
            if peer != me and peer not in present and now - at > ttl_s]


@dataclass(frozen=True)
class SinceVersion:
    """Where a fragment's wait for its next version started: when (unix s) and at which inner step of ours."""

    t: float
    step: int


def stalled_fragments(since: list[SinceVersion], step: int, inner_steps: int, step_time_s: float,
                      now: float) -> list[Alert]:
    """`fragment_stalled`: no new version of p for `STALL_ROUNDS` expected rounds (H inner steps at the
    members' median step time each) while this learner made that many rounds of steps (it sent deltas)."""
    if step_time_s <= 0 or inner_steps <= 0:
        return []
    round_s = inner_steps * step_time_s
    return [Alert(FRAGMENT_STALLED, WARNING, f"fragment {p}: no new version for {now - s.t:.0f}s, "
                  f"{step - s.step} inner steps (a round is about {round_s:.1f}s)", fragment=p)
            for p, s in enumerate(since)
            if now - s.t > STALL_ROUNDS * round_s and step - s.step >= STALL_ROUNDS * inner_steps]


def nonfinite_losses(loss: float | None, eval_loss: float | None) -> list[Alert]:
    """`nonfinite_loss`: the last training or evaluation loss is NaN or infinite."""
    bad = [f"{name} {x}" for name, x in (("loss", loss), ("eval_loss", eval_loss))
           if x is not None and not math.isfinite(x)]
    message = "non-finite " + ", ".join(bad) + ": the model diverged or its data is broken"
    return [Alert(NONFINITE_LOSS, ERROR, message)] if bad else []


def stale_fragments(labels: list[Version], newest: list[Version], max_staleness: int) -> list[Alert]:
    """`staleness`: this peer holds p more than `max_staleness` versions behind the newest it knows of (owners
    refuse its deltas on that base)."""
    return [Alert(STALENESS, WARNING, f"fragment {p}: holds {held}, {staleness(new, held)} versions behind "
                  f"{new} (max_staleness {max_staleness})", fragment=p)
            for p, (held, new) in enumerate(zip(labels, newest, strict=True))
            if staleness(new, held) > max_staleness]


class AlertBook:
    """Gives each alert its `since`: the time it was first raised, kept while it stays raised."""

    def __init__(self) -> None:
        self._since: dict[tuple[str, str | None, int | None], float] = {}

    def update(self, raised: list[Alert], now: float) -> list[Alert]:
        since, out = {}, []
        for a in raised:
            key = (a.kind, a.peer_id, a.fragment)
            since[key] = a.since if a.since is not None else self._since.get(key, now)
            out.append(replace(a, since=since[key]))
        self._since = since
        return out


# -- the observer -----------------------------------------------------------------------------------------

class Observer:
    """History samples and alerts of one peer. `observe` runs on the swarm's loop; the readers (`history`,
    `alerts`, `goodput`, `version_age`) may run on any thread."""

    def __init__(self, fragments: int, inner_steps: int, max_staleness: int, member_ttl_s: float) -> None:
        self.P, self.inner_steps = fragments, inner_steps
        self.max_staleness, self.ttl_s = max_staleness, member_ttl_s
        self.first: tuple[int, int] | None = None  # (step, merged_steps) at the first reading: goodput's zero
        self._samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY_KEPT)
        self._alerts: list[Alert] = []
        self._book = AlertBook()
        self._lock = threading.Lock()  # (the samples and alerts: a status may be read off the loop)
        self._labels: list[Version] = []
        self._moved_at: list[float | None] = [None] * fragments  # when this peer last moved p to a new one
        self._since: list[SinceVersion] = []
        self._sampled_at: float | None = None
        self.failures = 0

    def observe(self, r: Reading) -> None:
        """Take one reading: time the version moves, raise the alerts, keep a sample when one is due."""
        if self.first is None:
            self.first = (r.step, r.merged_steps)
            self._since = [SinceVersion(r.t, r.step)] * self.P
        else:
            for p, (old, new) in enumerate(zip(self._labels, r.labels, strict=True)):
                if new != old:
                    self._moved_at[p] = r.t
                    self._since[p] = SinceVersion(r.t, r.step)
        self._labels = list(r.labels)
        raised = [*silent_peers(r.heard, r.recorded, r.me, self.ttl_s, r.t),
                  *stalled_fragments(self._since, r.step, self.inner_steps, r.step_time_s, r.t),
                  *nonfinite_losses(r.loss, r.eval_loss),
                  *stale_fragments(r.labels, r.newest, self.max_staleness)]
        alerts = self._book.update(raised, r.t)
        due = self._sampled_at is None or r.t - self._sampled_at >= HISTORY_EVERY_S
        sample = self._sample(r) if due else None
        with self._lock:
            self._alerts = alerts
            if sample is not None:
                self._samples.append(sample)

    def _sample(self, r: Reading) -> dict[str, Any]:
        previous = self._samples[-1] if self._samples else None
        if previous is not None and r.t > previous["t"]:  # the throughput over the last interval
            tokens_per_s = (r.tokens - previous["tokens"]) / (r.t - previous["t"])
        else:
            tokens_per_s = r.tokens_per_s
        self._sampled_at = r.t
        return {"t": round(r.t, 3), "step": r.step, "tokens": r.tokens, "loss": finite(r.loss),
                "eval_loss": finite(r.eval_loss), "tokens_per_s": round(max(tokens_per_s, 0.0), 3),
                "goodput": self.goodput(r.merged_steps, r.step, r.delta_sent), "peers": r.peers,
                "bytes": r.traffic}

    def goodput(self, merged_steps: int, step: int, delta_sent: bool) -> float | None:
        return goodput(merged_steps, step, self.P, self.first, delta_sent)

    def history(self, after: float | None = None) -> list[dict[str, Any]]:
        """The samples kept, oldest first; only those taken after unix time `after` if given."""
        with self._lock:
            return [s for s in self._samples if after is None or s["t"] > after]

    def alerts(self) -> list[Alert]:
        with self._lock:
            return list(self._alerts)

    def version_age(self, p: int, now: float) -> float | None:
        """Seconds since this peer last moved fragment p to a new version (None: not since it started)."""
        at = self._moved_at[p]
        return None if at is None else round(max(0.0, now - at), 1)

    async def run(self, read_now: Callable[[], Reading]) -> None:
        """Observe every `TICK_S`, forever (cancelled at shutdown). A reading that fails is logged once and
        skipped: watching must never stop the training it watches."""
        while True:
            try:
                self.observe(read_now())
            except Exception as e:
                self.failures += 1
                if self.failures == 1:
                    log.exception("observer: a reading failed (%s); the history and alerts may lag", e)
            await asyncio.sleep(TICK_S)


# -- reading the swarm ------------------------------------------------------------------------------------

def distrusted(swarm: Swarm) -> set[str]:
    """Peers whose updates this peer refused (their reports of versions are not believed either)."""
    members = swarm.members
    out = set(swarm.sync.guard.distrusted) if swarm.sync is not None else set()
    if members is not None:
        out |= {peer for peer, until in members.suspects.items() if until == math.inf}
    return out


def known_newest(swarm: Swarm) -> list[Version]:
    """The newest version of each fragment this peer knows of: held, reported by a live member, or announced
    in the DHT (what the watch last read), from peers it trusts."""
    labels = swarm.store.labels()
    if swarm.sync is None or swarm.members is None:
        return labels
    untrusted = distrusted(swarm)
    live = {m.peer_id for m in swarm.members.live()} - untrusted
    reported = [v for peer, v in list(swarm.sync.reported.items()) if peer in live]
    announced = [a[0] if a is not None and a[1] not in untrusted else None for a in swarm.sync.announced]
    return newest_versions(labels, reported, announced)


def read(swarm: Swarm) -> Reading:
    """A `Reading` of `swarm`, on its loop."""
    pr, members, sync = swarm.progress, swarm.members, swarm.sync
    live = members.live() if members is not None else []
    stats = sync.stats if sync is not None else {}
    return Reading(
        t=time.time(), step=pr.step, tokens=pr.tokens, loss=pr.loss, eval_loss=pr.eval_loss,
        tokens_per_s=pr.tokens_per_s,
        step_time_s=median_step_time(pr.step_time_s if m.peer_id == swarm.identity.peer_id
                                     else m.record.step_time_s for m in live),
        labels=swarm.store.labels(), newest=known_newest(swarm), peers=len(live),
        merged_steps=swarm.store.merged_steps,
        delta_sent=delta_sent(stats),
        traffic=traffic(swarm.server.counters.served if swarm.server else {},
                        swarm.client.counters.sent if swarm.client else {}),
        heard=dict(members.heard) if members is not None else {},
        recorded=frozenset(m.peer_id for m in members.recorded()) if members is not None else frozenset(),
        me=swarm.identity.peer_id)


def member_state(peer_id: str, synced: bool, suspects: Mapping[str, float], untrusted: set[str]) -> str:
    if peer_id in untrusted:
        return "distrusted"
    if peer_id in suspects:
        return "suspect"
    return "training" if synced else "joining"


def history_after(query: str | None) -> float | None:
    """The `history_after` query parameter of `GET /v1/status`: unix seconds, or None if absent. Raises
    `Malformed` (400) for anything else."""
    if query is None:
        return None
    try:
        after = float(query)
    except ValueError:
        after = math.nan
    if not math.isfinite(after):
        raise Malformed(f"history_after must be unix seconds, got {query[:32]!r}")
    return after


def extend_status(out: dict[str, Any], swarm: Swarm, observer: Observer,
                  history_after: float | None = None) -> None:
    """Add the operator's keys (docs/status.md) to a status object `Swarm.status` assembled: top-level
    figures, history (the samples after `history_after` only, if given) and alerts, and per member and per
    fragment what the dashboard draws."""
    now = time.time()
    pr, members = swarm.progress, swarm.members
    labels = swarm.store.labels()
    newest = known_newest(swarm)
    stats = swarm.sync.stats if swarm.sync is not None else {}
    out.update({
        "eval_loss": finite(pr.eval_loss),
        "goodput": observer.goodput(swarm.store.merged_steps, pr.step, delta_sent(stats)),
        "member_ttl_s": swarm.config.member_ttl_s,
        "max_staleness": swarm.spec.max_staleness,
        "history": observer.history(history_after),
        "alerts": [a.to_json() for a in observer.alerts()],
    })
    heard = dict(members.heard) if members is not None else {}
    suspects = dict(members.suspects) if members is not None else {}
    untrusted = distrusted(swarm)
    records = {m.peer_id: m.record for m in members.recorded()} if members is not None else {}
    for m in out["members"]:
        record = records.get(m["peer_id"])  # (this peer's own: its current record)
        m["tokens_per_s"] = (finite(record.tokens_per_s) or 0.0) if record is not None else 0.0
        m["heartbeat_age_s"] = round(max(0.0, now - heard.get(m["peer_id"], now)), 1)
        m["state"] = member_state(m["peer_id"], m["synced"], suspects, untrusted)
    reported = dict(swarm.sync.reported) if swarm.sync is not None else {}
    reported[swarm.identity.peer_id] = labels
    live = {m["peer_id"] for m in out["members"]}
    for f in out["fragments"]:
        p = f["p"]
        f["owner"] = f["roles"][0] if f["roles"] else None
        f["replicas"] = f["roles"][1:]
        f["term"], f["number"] = labels[p].term, labels[p].version
        f["newest"] = str(newest[p])
        f["staleness"] = staleness(newest[p], labels[p])
        f["last_version_age_s"] = observer.version_age(p, now)
        f["member_staleness"] = {peer: staleness(newest[p], versions[p])
                                 for peer, versions in reported.items() if peer in live and p < len(versions)}

