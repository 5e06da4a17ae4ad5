"""`GET /metrics` and the operator's keys of `GET /v1/status` on a real two-peer swarm on loopback: the
Prometheus exposition parses and says what the peers did, and both statuses fit docs/status.schema.json."""

from __future__ import annotations

import copy
import json
import pathlib
import urllib.error
import urllib.request

import jsonschema
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from diloco.node.observe import ALERT_KINDS

from .swarm_utils import LocalLearner, get_status, tiny_run, wait_until

SCHEMA = json.loads((pathlib.Path(__file__).parent.parent / "docs" / "status.schema.json").read_text())
STEPS = 40


def scrape(url: str) -> tuple[str, dict[str, list]]:
    """The content type, and family name -> [(sample name, labels, value)]."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        content_type, text = r.headers["Content-Type"], r.read().decode()
    families = {f.name: [(s.name, s.labels, s.value) for s in f.samples]
                for f in text_string_to_metric_families(text)}
    return content_type, families


def value(families: dict, family: str, **labels) -> float:
    [v] = [v for _, ls, v in families[family] if all(ls.get(k) == x for k, x in labels.items())]
    return v


@pytest.fixture(scope="module")
def swarm():
    genesis = tiny_run()
    a = LocalLearner(genesis, 0).start()
    b = LocalLearner(genesis, 1, peers=[a.url]).start()
    peers = [a, b]
    try:
        wait_until(lambda: all(len(ll.learner.swarm.members.live()) == 2 for ll in peers), 20, "2 members")
        for _ in range(STEPS // 10):
            for ll in peers:
                ll.train(10)
        a.learner.swarm.progress.eval_loss = 2.5  # (what node/train.py does at each evaluation)

        def settled() -> bool:
            labels = [ll.learner.labels for ll in peers]
            return labels[0] == labels[1] and all(v.version > 0 for v in labels[0]) and all(
                ll.learner.swarm.sync.reported for ll in peers)  # (the watch asked the other for versions)

        wait_until(settled, 30, "both peers to hold the same versions, and to have asked each other")
        # and nothing still moving (a delta or a step in flight): the test compares a scrape with live counters
        last: list = []

        def still() -> bool:
            now = [(ll.learner.labels, list(ll.learner.swarm.shard.outer_steps), ll.learner.swarm.sync.stats["deltas_sent"])
                   for ll in peers]
            was, last[:] = list(last), now
            return was == now

        wait_until(still, 30, "the counters to stay still for a second", poll=1.0)
        yield genesis, peers
    finally:
        for ll in peers:
            ll.learner.close()


@pytest.mark.timeout(120)
def test_metrics_say_what_each_peer_did(swarm):
    genesis, peers = swarm
    P = genesis.spec.fragments
    scraped = [scrape(ll.url) for ll in peers]
    outer_steps = 0
    for ll, (content_type, m) in zip(peers, scraped, strict=True):
        sw = ll.learner.swarm
        assert content_type == CONTENT_TYPE_LATEST
        assert value(m, "diloco_inner_steps") == STEPS
        assert value(m, "diloco_tokens") == ll.learner.tokens > 0
        assert value(m, "diloco_healthy") == 1 and value(m, "diloco_synced") == 1
        assert value(m, "diloco_members", state="training") == 2
        assert value(m, "diloco_members", state="suspect") == 0
        [(_, info, _)] = m["diloco_info"]
        assert info["peer_id"] == sw.identity.peer_id and info["run_id"] == genesis.spec.run_id.hex()
        assert 0 < value(m, "diloco_step_seconds") < 10
        assert 0 <= value(m, "diloco_goodput") <= 1
        assert value(m, "diloco_deltas", side="sent", result="sent") == sw.sync.stats["deltas_sent"] > 0
        # one series per fragment, at the version this peer holds
        series = sorted(ls["fragment"] for _, ls, _ in m["diloco_fragment_version"])
        assert series == [str(p) for p in range(P)]
        for p, label in enumerate(ll.learner.labels):
            assert value(m, "diloco_fragment_version", fragment=str(p)) == label.version > 0
            assert value(m, "diloco_fragment_term", fragment=str(p)) == label.term
            assert value(m, "diloco_fragment_staleness", fragment=str(p)) == 0
            assert value(m, "diloco_outer_steps", fragment=str(p)) == sw.shard.outer_steps[p]
        outer_steps += sum(v for _, _, v in m["diloco_outer_steps"])
        assert {ls["kind"] for _, ls, _ in m["diloco_alerts"]} == set(ALERT_KINDS)
        assert value(m, "diloco_alerts", kind="nonfinite_loss") == 0
        assert {ls["reason"] for _, ls, _ in m["diloco_updates_refused"]} >= {"norm", "distrusted"}
        for direction in ("in", "out"):  # (the DHT is used both ways by every peer)
            assert value(m, "diloco_bytes", route="/v1/dht", direction=direction) > 0
        routes = {ls["route"] for _, ls, _ in m["diloco_bytes"]}
        assert not any("?" in r or r.rstrip("/").split("/")[-1].isdigit() for r in routes), routes
    assert outer_steps == sum(sum(ll.learner.swarm.shard.outer_steps) for ll in peers) > 0
    # the deltas went over the network to whichever peer owns each fragment, and so did their replication
    for route in ("/v1/delta", "/v1/replicate"):
        out = [value(m, "diloco_bytes", route=route, direction="out") for _, m in scraped
               if any(ls.get("route") == route for _, ls, _ in m["diloco_bytes"])]
        assert out and max(out) > 0, route
    assert value(scraped[0][1], "diloco_eval_loss") == 2.5
    assert scraped[1][1].get("diloco_eval_loss", []) == []  # (never evaluated: no sample)


@pytest.mark.timeout(120)
def test_both_statuses_fit_the_schema_and_show_the_operators_keys(swarm):
    genesis, peers = swarm
    validator = jsonschema.Draft202012Validator(SCHEMA)
    def sampled(ll) -> bool:  # two samples, the last one taken after the fixture's last step (every 5 s)
        history = ll.learner.swarm.observer.history()
        return len(history) >= 2 and history[-1]["step"] == STEPS

    wait_until(lambda: all(sampled(ll) for ll in peers), 20, "two samples, the last after the last step")
    ids = {ll.learner.swarm.identity.peer_id for ll in peers}

    def reports_current(ll) -> bool:  # (a member's versions are as of the last watch: 1 s in these tests)
        return all(set(f["member_staleness"]) == ids and not any(f["member_staleness"].values())
                   for f in get_status(ll.url)["fragments"])

    wait_until(lambda: all(reports_current(ll) for ll in peers), 15, "each peer's report of the other's")
    for ll in peers:
        st = get_status(ll.url)
        validator.validate(st)
        assert st["member_ttl_s"] == ll.learner.config.member_ttl_s
        assert st["max_staleness"] == genesis.spec.max_staleness
        assert 0 <= st["goodput"] <= 1 and st["alerts"] == []
        assert {m["peer_id"] for m in st["members"]} == ids
        for m in st["members"]:
            assert m["state"] == "training" and 0 <= m["heartbeat_age_s"] <= st["member_ttl_s"]
            assert m["tokens_per_s"] > 0
        for f in st["fragments"]:
            assert f["owner"] == f["roles"][0] and f["replicas"] == f["roles"][1:]
            assert f"{f['term']}.{f['number']}" == f["version"] == f["newest"] and f["staleness"] == 0
            assert f["last_version_age_s"] is not None and f["last_version_age_s"] >= 0
            assert set(f["member_staleness"]) == ids and set(f["member_staleness"].values()) == {0}
        history = st["history"]
        assert history == sorted(history, key=lambda s: s["t"]) and history[-1]["step"] == STEPS
        assert history[-1]["bytes"]["/v1/dht"]["in"] > 0 and history[-1]["peers"] == 2
        with urllib.request.urlopen(f"{ll.url}/v1/status?history_after={history[-2]['t']}", timeout=5) as r:
            assert [s["t"] for s in json.loads(r.read())["history"]][0] > history[-2]["t"]
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(f"{ll.url}/v1/status?history_after=soon", timeout=5)
        assert bad.value.code == 400
    # the schema is not a formality: a wrong type, an unknown state, a missing key are refused
    st = get_status(peers[0].url)
    for broken in (lambda s: s.update(step="forty"), lambda s: s["members"][0].update(state="asleep"),
                   lambda s: s["fragments"][0].pop("staleness"), lambda s: s.update(goodput=1.5),
                   lambda s: s["alerts"].append({"kind": "peer_silent", "severity": "fatal", "message": "",
                                                 "since": 0, "peer_id": None, "fragment": None})):
        wrong = copy.deepcopy(st)
        broken(wrong)
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(wrong)
