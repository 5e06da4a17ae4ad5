"""The live terminal view (node/live.py): what it draws, and that piped or JSON output stays as it was."""

from __future__ import annotations

import io
import re
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web
from rich.console import Console

from diloco.node import live
from diloco.node.demo import Demo, DemoOptions, PeerView, _versions_text
from diloco.node.train import TrainOptions, emit

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
ME, OTHER = "HFbt9fx4rtCmhFVwSEXRa7CGDZHwfFkmbMsF43Zz5u4t", "Ag4HbMgwz7QjQtErCHU4664KbrZdQnH48VEjV5SxAyWc"


def rendered(renderable) -> str:
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=130).print(renderable)
    return ANSI.sub("", out.getvalue())


def status(**extra) -> dict:
    """A status of docs/status.md's shape; `extra` adds (or overrides) keys."""
    frag = [{"p": 0, "version": "115576.16", "roles": [ME, OTHER], "outer_steps": 5, "momentum": None},
            {"p": 1, "version": "163149.4", "roles": [OTHER, ME], "outer_steps": 0, "momentum": None}]
    return {"peer_id": ME, "run_id": "4c508f47e14b" + "0" * 52, "run_name": "doc", "url": "http://127.0.0.1:7301",
            "client_mode": False, "step": 40, "tokens": 40960, "loss": 2.5, "tokens_per_s": 8000.0, "synced": True,
            "healthy": True, "error": None, "fragments": frag,
            "members": [{"peer_id": OTHER, "step": 17}, {"peer_id": ME, "step": 40}],
            "bytes_total": {"bytes_in": 500_000, "bytes_out": 1_500_000}, **extra}


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_versions_read_as_a_person_reads_them():
    assert live.version_text("115576.16") == "v16 · term 115576"
    assert live.version_text("0.0") == "v0 · initial"
    assert live.version_text(None) == live.version_text("garbage") == "—"
    assert _versions_text(["115576.16", "0.0"]) == "p0 v16 · term 115576, p1 v0 · initial"
    assert _versions_text([]) == "-"


def test_the_learner_view_shows_step_loss_speed_peers_fragments_and_goodput():
    view = live.LearnerView(steps=100)
    printed: list[str] = []
    view.printer = printed.append
    view.feed("progress", {"step": 40, "loss": 2.4321, "tokens": 40960, "peers": 2, "merged_steps": 120}, "[progress] …")
    view.feed("eval", {"step": 40, "eval_loss": 2.61}, "[eval] step=40 eval_loss=2.6100")
    assert printed == ["[eval] step=40 eval_loss=2.6100"], "progress goes into the view, other events above it"
    view.poll(lambda: status(goodput=0.93, eval_loss=2.6, max_staleness=2,
                             fragments=[{"p": 0, "version": "115576.16", "roles": [ME, OTHER], "owner": ME,
                                         "last_version_age_s": 12.0, "staleness": 0},
                                        {"p": 1, "version": "163149.4", "roles": [OTHER, ME], "owner": OTHER,
                                         "last_version_age_s": 3.0, "staleness": 3}]))
    text = rendered(view.render())
    for shown in ("run doc (4c508f47e14b)", "peer HFbt9fx4", "synced", "40/100", "2.432", "2.600", "8,000",
                  "93.0%", "2.00", "v16 · term 115576", "v4 · term 163149", "HFbt9fx4 (this peer)", "Ag4HbMgw",
                  "12s ago", "3s ago"):
        assert shown in text, f"{shown!r} not in\n{text}"
    assert "115576.16" not in text, "no glued term.version"


def test_the_learner_view_works_on_a_status_without_the_newer_keys():
    view = live.LearnerView(steps=0)
    view.feed("progress", {"step": 40, "loss": 2.5, "tokens": 40960, "merged_steps": 40}, "")
    view.poll(status)  # no goodput, eval_loss, staleness, last_version_age_s
    text = rendered(view.render())
    assert "v16 · term 115576" in text and "50.0%" in text, text  # goodput: 40 merged / (2 fragments · 40 steps)
    assert "—" in text  # eval loss, staleness, age unknown
    view.poll(lambda: status(fragments=[{"p": 0, "version": "115576.17", "roles": [ME]}]))
    again = rendered(view.render())  # (a second poll within STATUS_EVERY_S: not read)
    assert "v16 · term 115576" in again and "v17" not in again


def test_a_status_read_that_fails_keeps_training_and_the_last_status():
    view = live.LearnerView()
    view.poll(status)
    view._status_at = 0.0

    def broken() -> dict:
        raise RuntimeError("dictionary changed size during iteration")

    view.poll(broken)
    assert view.status["run_name"] == "doc"


def test_the_view_is_wanted_only_on_a_terminal_without_machine_output(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    assert live.wanted(Tty(), json_lines=False, log_format="text")
    assert not live.wanted(io.StringIO(), json_lines=False, log_format="text")
    assert not live.wanted(Tty(), json_lines=True, log_format="text")
    assert not live.wanted(Tty(), json_lines=False, log_format="json")
    monkeypatch.setenv("TERM", "dumb")
    assert not live.wanted(Tty(), json_lines=False, log_format="text")


def test_piped_output_keeps_the_plain_lines(capsys):
    opts = TrainOptions(steps=10)
    with live.join_view(opts, "text", stream=io.StringIO()):
        assert opts.view is None
        emit(opts, "progress", step=10, loss=2.5, tokens=10240, peers=2)
    assert capsys.readouterr().out == "[progress] step=10 loss=2.5000 tokens=10240 peers=2\n"


def test_json_log_format_on_a_terminal_draws_no_live_view(capsys, monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    tty = Tty()
    opts = TrainOptions(steps=10)
    with live.join_view(opts, "json", stream=tty):
        assert opts.view is None
        emit(opts, "progress", step=10, loss=2.5)
    assert tty.getvalue() == "" and capsys.readouterr().out == "[progress] step=10 loss=2.5000\n"


def test_a_terminal_gets_the_live_view_and_the_other_events_above_it(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("RANK", raising=False)
    tty = Tty()
    opts = TrainOptions(steps=50)
    with live.join_view(opts, "text", stream=tty):
        assert opts.view is not None
        emit(opts, "joined", peer_id=ME, url="http://127.0.0.1:7301")
        emit(opts, "progress", step=20, loss=2.25, tokens=20480, peers=3)
        opts.view.poll(status)
    assert opts.view is None
    text = ANSI.sub("", tty.getvalue())
    assert f"[joined] peer_id={ME} url=http://127.0.0.1:7301" in text
    assert "[progress]" not in text and "diloco-node join" in text and "v16 · term 115576" in text


@pytest.mark.timeout(60)
def test_the_demo_table_polls_each_learners_status(tmp_path: Path):
    served = status(goodput=0.5, fragments=[{"p": 0, "version": "115576.16", "roles": [ME], "staleness": 1,
                                             "last_version_age_s": 4.0}])

    async def serve(request: web.Request) -> web.Response:
        return web.json_response(served)

    app = web.Application()
    app.router.add_get("/v1/status", serve)
    ready, stop = threading.Event(), threading.Event()
    port: list[int] = []

    def server() -> None:
        import asyncio

        async def main() -> None:
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port.append(site._server.sockets[0].getsockname()[1])  # noqa: SLF001
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await runner.cleanup()

        asyncio.run(main())

    t = threading.Thread(target=server, daemon=True)
    t.start()
    assert ready.wait(10)
    demo = Demo(DemoOptions(peers=1, steps=100, fragments=1, workdir=tmp_path, live=True), out=io.StringIO())
    demo.views.append(PeerView(0, tmp_path / "k", tmp_path / "log", peer_id=ME, state="training", step=30,
                               loss=2.75))
    poller = live.StatusPoller(every_s=0.1).start()
    try:
        poller.watch(0, f"http://127.0.0.1:{port[0]}")
        deadline = time.monotonic() + 10
        while not poller.latest(0) and time.monotonic() < deadline:
            time.sleep(0.05)
        text = rendered(live.demo_table(demo, poller))
    finally:
        poller.stop()
        stop.set()
        t.join(5)
    for shown in ("30/100", "2.750", "8,000", "50.0%", "fragments, as learner 0 sees them", "v16 · term 115576",
                  "4s ago"):
        assert shown in text, f"{shown!r} not in\n{text}"
