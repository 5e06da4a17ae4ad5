"""`GET /metrics`: the peer's counters in the Prometheus text format (docs/status.md "Metrics").

A scrape reads the swarm's own counters at that moment (a custom collector on a registry of this swarm's
own: several swarms share a test process, and nothing here is global). The figures are those of
`/v1/status`; Prometheus keeps their history, so none is kept here.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from . import observe

if TYPE_CHECKING:
    from .swarm import Swarm

MEMBER_STATES = ("training", "joining", "suspect", "distrusted")


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    """A gauge; without a sample while `value` is None (NaN and ±Inf are written as such)."""
    g = GaugeMetricFamily(name, doc)
    if value is not None:
        g.add_metric([], value)
    return g


def labelled(kind: type[Metric], name: str, doc: str, labels: list[str],
             rows: Iterable[tuple[Iterable[str], float]]) -> Metric:
    """A family of `kind` (a Counter- or GaugeMetricFamily): one sample per (label values, value)."""
    family = kind(name, doc, labels=labels)
    for values, value in rows:
        family.add_metric(list(values), value)
    return family


def refusals(stats: Mapping[str, int]) -> list[tuple[tuple[str], int]]:
    """The sync's counters of refused updates by reason (docs/status.md `sync`): the guard's own checks split
    into norm, own_delta and the rest (a replica's failed audit, a delta named twice), then the others."""
    checks, norm, own = stats.get("updates_refused", 0), stats.get("updates_refused_norm", 0), \
        stats.get("updates_refused_own_delta", 0)
    return [(("norm",), norm), (("own_delta",), own), (("other",), max(0, checks - norm - own)),
            (("distrusted",), stats.get("updates_refused_distrusted", 0)),
            (("unauthorized",), stats.get("updates_unauthorized", 0))]


class SwarmCollector:
    """Every metric of one swarm, read when scraped (on the swarm's loop: the route's handler runs there)."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm

    def collect(self) -> Iterator[Metric]:
        s = self.swarm
        pr = s.progress
        shard_stats = dict(s.shard.stats) if s.shard else {}
        sync_stats = dict(s.sync.stats) if s.sync else {}
        yield InfoMetricFamily("diloco", "This peer and its run.",
                               value={"peer_id": s.identity.peer_id, "run_id": s.spec.run_id.hex(),
                                      "run_name": s.spec.name, "url": s.url})
        yield counter("diloco_inner_steps", "Inner steps done (a resumed learner counts from its "
                      "checkpoint).", pr.step)
        yield counter("diloco_tokens", "Tokens trained.", pr.tokens)
        yield gauge("diloco_loss", "The last training loss passed to Learner.step.", pr.loss)
        yield gauge("diloco_eval_loss", "The last held-out evaluation loss reported.", pr.eval_loss)
        yield gauge("diloco_goodput", "Share of this process's inner steps merged into accepted versions.",
                    s.observer.goodput(s.store.merged_steps, pr.step, observe.delta_sent(sync_stats)))
        yield counter("diloco_merged_fragment_steps", "Fragment-steps of this learner's deltas merged into "
                      "versions it received (checkpointed).", s.store.merged_steps)
        yield gauge("diloco_step_seconds", "EWMA of the wall time between two inner steps.", pr.step_time_s)
        yield gauge("diloco_tokens_per_second", "Tokens of the last step / diloco_step_seconds.",
                    pr.tokens_per_s)
        yield gauge("diloco_synced", "1 once the join is done (every fragment synced).", int(pr.synced))
        yield gauge("diloco_healthy", "1 while the background loop runs.", int(s.error is None))
        yield counter("diloco_task_failures", "One-off background tasks that raised.", s.task_failures)
        yield counter("diloco_connections_opened", "TCP connections opened to other peers.",
                      s.client.counters.connections_opened if s.client else 0)
        yield labelled(GaugeMetricFamily, "diloco_members",
                       "Members whose record has not expired, by state (this peer included).", ["state"],
                       [((state,), n) for state, n in self._states().items()])
        deltas = [((side, name.removeprefix("deltas_")), n)
                  for side, table in (("received", shard_stats), ("sent", sync_stats))
                  for name, n in sorted(table.items()) if name.startswith("deltas_")]
        yield labelled(CounterMetricFamily, "diloco_deltas", "Deltas by side (received: as owner, sent: as "
                       "learner) and result (the counter's name after deltas_).", ["side", "result"], deltas)
        yield from self._traffic()
        yield from self._fragments()
        yield labelled(CounterMetricFamily, "diloco_updates_refused",
                       "Updates and certificates this learner refused, by reason.", ["reason"],
                       refusals(sync_stats))
        kinds = Counter(a.kind for a in s.observer.alerts())
        yield labelled(GaugeMetricFamily, "diloco_alerts", "Alerts raised now, by kind.", ["kind"],
                       [((kind,), kinds[kind]) for kind in observe.ALERT_KINDS])
        for name, table in (("shard", shard_stats), ("sync", sync_stats)):
            yield labelled(CounterMetricFamily, f"diloco_{name}_events",
                           f"Every counter of `{name}` in /v1/status, by name.", ["event"],
                           [((event,), n) for event, n in sorted(table.items())])

    def _states(self) -> dict[str, int]:
        s, members = self.swarm, self.swarm.members
        states = dict.fromkeys(MEMBER_STATES, 0)
        if members is not None:
            untrusted, suspects = observe.distrusted(s), dict(members.suspects)
            for m in members.recorded():
                states[observe.member_state(m.peer_id, m.record.synced, suspects, untrusted)] += 1
        return states

    def _traffic(self) -> Iterator[Metric]:
        s = self.swarm
        served = s.server.counters.served if s.server else {}
        sent = s.client.counters.sent if s.client else {}
        rows = [((route, direction), row[direction])
                for route, row in sorted(observe.traffic(served, sent).items())
                for direction in ("in", "out")]
        yield labelled(CounterMetricFamily, "diloco_bytes", "Bytes by route pattern and direction (in: "
                       "received by this peer, out: sent by it), served and sent requests together.",
                       ["route", "direction"], rows)
        totals: dict[tuple[str, str], list[int]] = {}
        for side, table in (("served", served), ("sent", sent)):
            for path, c in list(table.items()):
                row = totals.setdefault((observe.route_of(path), side), [0, 0])
                row[0] += c.requests
                row[1] += c.errors
        yield labelled(CounterMetricFamily, "diloco_requests", "Requests by route pattern and side (served: "
                       "answered by this peer, sent: made by it).", ["route", "side"],
                       [(key, n) for key, (n, _) in sorted(totals.items())])
        yield labelled(CounterMetricFamily, "diloco_request_errors", "Requests without a usable answer "
                       "(status >= 400, no connection, deadline), by route pattern and side.",
                       ["route", "side"], [(key, e) for key, (_, e) in sorted(totals.items())])

    def _fragments(self) -> Iterator[Metric]:
        s, now = self.swarm, time.time()
        labels, newest = s.store.labels(), observe.known_newest(s)
        ps = range(len(labels))
        owned = s.shard.owners if s.shard else {}
        outer = list(s.shard.outer_steps) if s.shard else [0] * len(labels)
        for kind, name, doc, values in (
            (GaugeMetricFamily, "diloco_fragment_version", "Version number of the fragment this peer holds.",
             [v.version for v in labels]),
            (GaugeMetricFamily, "diloco_fragment_term", "Term of the version this peer holds.",
             [v.term for v in labels]),
            (GaugeMetricFamily, "diloco_fragment_staleness",
             "Versions between the newest version this peer knows of and the one it holds.",
             [observe.staleness(n, v) for n, v in zip(newest, labels, strict=True)]),
            (GaugeMetricFamily, "diloco_fragment_owned", "1 while this peer owns the fragment.",
             [int(p in owned) for p in ps]),
            (CounterMetricFamily, "diloco_outer_steps",
             "Versions of the fragment this peer published as owner since it started.", outer),
            (GaugeMetricFamily, "diloco_fragment_version_age_seconds", "Seconds since this peer last moved "
             "the fragment to a new version (no sample: not since it started).",
             [s.observer.version_age(p, now) for p in ps]),
        ):
            yield labelled(kind, name, doc, ["fragment"],
                           [((str(p),), v) for p, v in zip(ps, values, strict=True) if v is not None])


def registry(swarm: Swarm) -> CollectorRegistry:
    """A registry of this swarm's own, with its collector."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SwarmCollector(swarm))
    return reg


def handler(swarm: Swarm) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The `GET /metrics` handler of `swarm`."""
    reg = registry(swarm)

    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(reg), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return serve
