"""The browser dashboard (node/dashboard/): served by real peers, rendered by a real headless Chromium.

Chromium is a system package: CI installs it (.ci/run). Without it these tests fail under CI (the `CI`
variable set) and are skipped elsewhere. Set DILOCO_DASHBOARD_SHOTS=DIR to keep the screenshots there too.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from diloco.node import dashboard
from diloco.protocol.identity import Identity
from diloco.protocol.transport import PeerServer

from .swarm_utils import LocalLearner, tiny_run, wait_until

WINDOW = "1366,768"  # a laptop screen
VERSION = re.compile(r"v[1-9]\d* · term \d+")


def chromium() -> str:
    found = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("the dashboard tests need headless Chromium and none is installed: .ci/run installs it with "
                    "`apt-get install chromium`; install it there (or on this runner) first")
    pytest.skip("chromium is not installed (apt-get install chromium); CI installs it and runs these tests")


def browser_args(tmp: Path, budget_ms: int) -> list[str]:
    return [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
            "--disable-extensions", "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'chromium-profile'}",
            f"--window-size={WINDOW}", f"--virtual-time-budget={budget_ms}"]


def browse(url: str, tmp: Path, budget_ms: int = 5000) -> str:
    """The page's DOM after `budget_ms` of (virtual) time: what a person would see, as HTML."""
    r = subprocess.run([*browser_args(tmp, budget_ms), "--dump-dom", url], capture_output=True, text=True,
                       timeout=90)
    assert r.returncode == 0, f"chromium failed ({r.returncode}): {r.stderr[-2000:]}"
    return r.stdout


def screenshot(url: str, tmp: Path, name: str, budget_ms: int = 5000) -> Path:
    out = tmp / name
    r = subprocess.run([*browser_args(tmp, budget_ms), f"--screenshot={out}", url], capture_output=True, text=True,
                       timeout=90)
    assert r.returncode == 0 and out.stat().st_size > 10_000, f"no screenshot ({r.returncode}): {r.stderr[-2000:]}"
    keep = os.environ.get("DILOCO_DASHBOARD_SHOTS")
    if keep:
        shutil.copy(out, Path(keep) / name)
    return out


def text_of(dom: str) -> str:
    """The visible text of a dumped DOM, roughly: tags dropped, entities of the page's own text decoded."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom)).replace("&amp;", "&").replace("&gt;", ">")


# -- the files and routes -----------------------------------------------------------------------------------


async def test_the_dashboard_files_are_served_and_nothing_else():
    server = PeerServer("127.0.0.1", 0)
    dashboard.register(server)
    await server.start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/") as r:
                page = await r.text()
                assert r.status == 200 and r.content_type == "text/html"
                assert "connect-src 'self'" in r.headers["Content-Security-Policy"]
            assert 'src="dashboard/app.js"' in page and 'href="dashboard/style.css"' in page
            assert "http" not in re.sub(r'href="v1/status"', "", page.split("<body>")[1]), "nothing fetched from elsewhere"
            for name, kind in dashboard.ASSETS.items():
                async with s.get(f"{server.url}/dashboard/{name}") as r:
                    assert r.status == 200 and r.content_type == kind
                    body = await r.text()
                    assert "http://" not in body.replace("http://www.w3.org/2000/svg", "")
                    assert "https://" not in body
            for bad in ("index.html", "__init__.py", "..%2F__init__.py", "nope.js"):
                async with s.get(f"{server.url}/dashboard/{bad}") as r:
                    assert r.status == 404, bad
    finally:
        await server.stop()


# -- a real two-peer swarm in a real browser ----------------------------------------------------------------


@pytest.mark.timeout(240)
def test_a_two_peer_swarm_shows_both_peers_and_fragment_versions(tmp_path):
    chromium()  # (before any swarm starts)
    genesis = tiny_run()
    first = LocalLearner(genesis, 0).start()
    learners = [first]
    stop = threading.Event()
    trainer: threading.Thread | None = None
    try:
        learners.append(LocalLearner(genesis, 1, peers=[first.url]).start())
        wait_until(lambda: all(len(ll.learner.swarm.members.live()) == 2 for ll in learners), 30, "2 live members")

        def train() -> None:  # (each learner's steps from this one thread)
            while not stop.is_set():
                for ll in learners:
                    ll.train(2)
                time.sleep(0.05)

        trainer = threading.Thread(target=train, daemon=True, name="dashboard-trainer")
        trainer.start()
        wait_until(lambda: any(v.version > 0 for v in first.learner.labels), 60, "a fragment's first version")
        ids = [ll.learner.swarm.identity.peer_id for ll in learners]
        deadline, text = time.monotonic() + 60, ""
        while time.monotonic() < deadline:
            text = text_of(browse(first.url + "/", tmp_path))
            if all(pid[:8] in text for pid in ids) and VERSION.search(text):
                break
            time.sleep(1)
        assert all(pid[:8] in text for pid in ids), f"both peers on the page: {text[:3000]}"
        assert VERSION.search(text), f"a fragment version like 'v1 · term N' on the page: {text[:3000]}"
        assert "peers (2)" in text and "this peer" in text
        assert "fragments (4" in text, text[:3000]
        wait_until(lambda: len(first.learner.status().get("history", [])) >= 4, 60, "4 history samples", poll=1)
        screenshot(first.url + "/", tmp_path, "dashboard.png", budget_ms=7000)
    finally:
        stop.set()
        if trainer is not None:
            trainer.join(timeout=30)
        for ll in learners:
            ll.learner.close()


# -- 100 members, 16 fragments: the layout holds ------------------------------------------------------------

REGIONS = ["us-east", "us-west", "eu-west", "eu-central", "ap-south", "ap-northeast", "sa-east", ""]
ROUTES = ["/v1/delta", "/v1/update", "/v1/replicate", "/v1/dht", "/v1/fragment/{p}", "/v1/updates/{p}",
          "/v1/status", "/v1/momentum/{p}"]


def synthetic_status(members: int = 100, fragments: int = 16, samples: int = 120) -> dict:
    """A status object of the documented shape (docs/status.md and its additions) for a big swarm."""
    rng = random.Random(7)
    ids = [Identity.generate().peer_id for _ in range(members)]
    me = ids[-1]
    now = time.time()
    ttl = 30.0
    states = ["training"] * 90 + ["joining"] * 5 + ["suspect"] * 3 + ["distrusted"] * 2
    rows = []
    for i, pid in enumerate(ids):
        hb = 26.0 if i == 3 else rng.uniform(0.2, 12.0)
        rows.append({"peer_id": pid, "url": f"http://10.0.{i // 250}.{i % 250}:7000", "step": rng.randint(900, 4200),
                     "region": REGIONS[i % len(REGIONS)], "client_mode": i % 17 == 5, "synced": states[i] == "training",
                     "expires_in_s": round(ttl - hb, 1), "tokens_per_s": rng.uniform(6000, 9000),
                     "heartbeat_age_s": round(hb, 1), "state": "training" if pid == me else states[i]})
    servers = [r["peer_id"] for r in rows if not r["client_mode"]]
    frags = []
    for p in range(fragments):
        roles = rng.sample(servers, 3)
        term, number = (rng.randint(1, 9) << 16) + rng.randint(0, 65535), rng.randint(3, 180)
        behind = 3 if p == 5 else (1 if p % 6 == 1 else 0)
        frags.append({"p": p, "version": f"{term}.{number - behind}", "roles": roles, "outer_steps": rng.randint(0, 40),
                      "momentum": None, "owner": roles[0], "replicas": roles[1:], "term": term,
                      "number": number - behind, "newest": f"{term}.{number}", "staleness": behind,
                      "last_version_age_s": round(rng.uniform(0.5, 40.0), 1) if p != 9 else 412.0,
                      "member_staleness": {pid: rng.choice([0] * 12 + [1, 1, 2, 4]) for pid in ids}})
    history, loss, cum = [], 4.1, dict.fromkeys(ROUTES, 0)
    for k in range(samples):
        loss = loss * 0.985 + 0.02 * rng.random()
        for j, route in enumerate(ROUTES):
            cum[route] += int(rng.uniform(0.5, 1.5) * 2_000_000 / (j + 1))
        history.append({"t": now - 5 * (samples - k), "step": 30 * k, "tokens": 30_720 * k, "loss": loss,
                        "eval_loss": loss + 0.08 if k % 6 == 0 or k > 2 else None,
                        "tokens_per_s": rng.uniform(7000, 8500), "goodput": min(1.0, 0.7 + k / 400), "peers": members,
                        "bytes": {r: {"in": c // 2, "out": c - c // 2} for r, c in cum.items()}})
    return {
        "peer_id": me, "run_id": "ab" * 32, "run_name": "big-run", "url": rows[-1]["url"], "client_mode": False,
        "step": 3600, "tokens": 3_686_400, "loss": loss, "step_time_s": 0.125, "tokens_per_s": 8192.0, "synced": True,
        "healthy": True, "error": None, "task_failures": 0, "fragments": frags, "members": rows, "shard": {},
        "sync": {}, "bytes": {"served": {}, "sent": {}}, "bytes_total": {"bytes_in": 81_000_000, "bytes_out": 95_000_000},
        "connections_opened": 400, "eval_loss": loss + 0.08, "goodput": 0.93, "member_ttl_s": ttl, "max_staleness": 2,
        "history": history,
        "alerts": [
            {"kind": "peer_silent", "severity": "warning", "message": f"{ids[3][:8]} not heard from for 26 s",
             "since": now - 26, "peer_id": ids[3], "fragment": None},
            {"kind": "staleness", "severity": "error", "message": "fragment 5 is 3 versions behind (max 2)",
             "since": now - 60, "peer_id": None, "fragment": 5},
            {"kind": "fragment_stalled", "severity": "warning", "message": "fragment 9: no new version for 5 rounds",
             "since": now - 300, "peer_id": None, "fragment": 9},
        ],
    }


@pytest.mark.timeout(240)
async def test_a_hundred_members_and_sixteen_fragments_fit_a_laptop_screen(tmp_path):
    status = synthetic_status()
    body = json.dumps(status).encode()

    async def serve_status(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_route("GET", "/v1/status", serve_status)
    dashboard.register(app.router)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/"  # noqa: SLF001
    try:
        proc = await asyncio.create_subprocess_exec(*browser_args(tmp_path, 5000), "--dump-dom", url,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 90)
        assert proc.returncode == 0, err.decode()[-2000:]
        dom = out.decode()
        assert len(re.findall(r'<tr[^>]* data-peer="', dom)) == 100, "one row per member"
        assert len(re.findall(r'<div class="frag[^"]*" data-p="', dom)) == 16, "one card per fragment"
        assert len(re.findall(r'class="sq ', dom)) == 16 * 100, "one square per fragment and learner"
        text = text_of(dom)
        f5 = status["fragments"][5]
        assert f"v{f5['number']} · term {f5['term']}" in text, "versions read as v<N> · term <T>"
        assert "fragment 5 is 3 versions behind" in text and "peer_silent" in text
        assert 'class="num bad-text"' in dom, "a heartbeat past half the member TTL shows red"
        assert "peers (100)" in text and "93.0%" in text
        proc = await asyncio.create_subprocess_exec(*browser_args(tmp_path, 5000), f"--screenshot={tmp_path / 'shot.png'}",
                                                    url, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 90)
        assert proc.returncode == 0 and (tmp_path / "shot.png").stat().st_size > 10_000, err.decode()[-2000:]
        keep = os.environ.get("DILOCO_DASHBOARD_SHOTS")
        if keep:
            shutil.copy(tmp_path / "shot.png", Path(keep) / "dashboard100.png")
    finally:
        await runner.cleanup()


async def serve_then_browse(tmp: Path, handler) -> str:
    """The dashboard next to `handler` as `GET /v1/status` on a loopback aiohttp app, read by Chromium."""
    app = web.Application()
    app.router.add_route("GET", "/v1/status", handler)
    dashboard.register(app.router)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/"  # noqa: SLF001
    try:
        proc = await asyncio.create_subprocess_exec(*browser_args(tmp, 5000), "--dump-dom", url,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 90)
        assert proc.returncode == 0, err.decode()[-2000:]
        return out.decode()
    finally:
        await runner.cleanup()


@pytest.mark.timeout(120)
async def test_a_status_without_the_newer_keys_still_draws_and_a_dead_peer_says_so(tmp_path):
    older = {k: v for k, v in synthetic_status(members=8, fragments=2, samples=0).items()
             if k not in ("eval_loss", "goodput", "member_ttl_s", "max_staleness", "history", "alerts")}
    for m in older["members"]:
        for k in ("tokens_per_s", "heartbeat_age_s", "state"):
            m.pop(k)
    for f in older["fragments"]:
        for k in ("owner", "replicas", "term", "number", "newest", "staleness", "last_version_age_s",
                  "member_staleness"):
            f.pop(k)

    async def old_peer(request: web.Request) -> web.Response:
        return web.json_response(older)

    text = text_of(await serve_then_browse(tmp_path, old_peer))
    term, number = older["fragments"][0]["version"].split(".")
    assert f"v{number} · term {term}" in text, "versions split from the T.V string"
    assert "peers (8)" in text and "fragments (2)" in text and "—" in text

    async def dying_peer(request: web.Request) -> web.Response:
        return web.Response(status=503, text="peer is shutting down\n")

    text = text_of(await serve_then_browse(tmp_path, dying_peer))
    assert "cannot reach this peer: HTTP 503 peer is shutting down" in text
