"""`diloco-node report`: a real two-learner demo's directory turned into PNG plots, and the staleness and
grouping rules of node/report.py on event files of the three layouts."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from diloco.node.report import PLOTS, load, staleness

from .test_cli_errors import run_cli
from .test_demo import demo_workdir  # noqa: F401 - the fixture: no learner outlives the test

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (asserting the signature and the chunk's place)."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


@pytest.mark.timeout(240)
def test_report_of_a_real_demo_writes_every_plot(request):
    demo_dir = request.getfixturevalue("demo_workdir")
    r = run_cli("demo", "--peers", "2", "--steps", "100", "--inner-steps", "10", "--progress-every", "5",
                "--json", "--out", str(demo_dir), "--timeout", "150", timeout=180)
    assert r.returncode == 0, f"demo exited with {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    for i in (0, 1):  # the learners' own event lines, teed by `join --out`
        kinds = [json.loads(line)["event"] for line in (demo_dir / f"learner-{i}" / "events.jsonl").open()]
        assert kinds[0] == "joined" and kinds[-1] == "done" and "progress" in kinds, kinds

    r = run_cli("report", str(demo_dir), timeout=120)
    assert r.returncode == 0, r.stderr
    out = demo_dir / "report"
    assert r.stdout.splitlines() == [f"wrote {out / name}" for name in PLOTS], r.stdout
    for name in PLOTS:
        width, height = png_size(out / name)
        assert (width, height) == (960, 540), name  # 8 × 4.5 inches at 120 dpi
        assert (out / name).stat().st_size > 15_000, f"{name} looks empty"


def test_report_of_an_empty_or_missing_directory_is_one_line(tmp_path):
    for target in (tmp_path, tmp_path / "missing"):
        r = run_cli("report", str(target), timeout=60)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    assert lines[0] == f"Error: {tmp_path / 'missing'} is not a directory (give the --out directory of join, " \
                       "demo or chaos)"
    r = run_cli("report", str(tmp_path), timeout=60)
    assert r.stderr.strip() == (f"Error: no learner events under {tmp_path}: expected the *.jsonl files that "
                                "`join --out`, `demo --out` or `chaos --out` write")


def _write(path: Path, events: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def test_a_single_learner_without_a_swarm_gets_its_loss_plots_and_the_reasons_for_the_rest(tmp_path):
    _write(tmp_path / "events.jsonl", [  # what `join --standalone --out DIR` writes
        {"event": "joined", "t": 100.0, "peer_id": "p", "url": "", "step": 0, "standalone": True},
        *({"event": "progress", "t": 100.0 + s, "step": s, "loss": 4.0 - s / 10, "tokens": 512 * s,
           "steps_per_s": 1.0} for s in range(1, 11)),
        {"event": "done", "t": 111.0, "steps": 10, "tokens": 5120, "final_loss": 3.1, "eval_loss": 3.2},
    ])
    r = run_cli("report", str(tmp_path), "--out", str(tmp_path / "plots"), timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"wrote {tmp_path / 'plots' / 'loss_vs_time.png'}",
        f"wrote {tmp_path / 'plots' / 'loss_vs_tokens.png'}",
        "skipped goodput.png: no progress event with merged_steps (a standalone run?)",
        "skipped bytes_per_step.png: fewer than two progress events with bytes per learner",
        "skipped staleness.png: needs the version moves of at least 2 learners of one run (join --json or --out)",
    ]
    assert png_size(tmp_path / "plots" / "loss_vs_time.png") == (960, 540)


def test_streams_are_grouped_per_directory_and_the_harness_log_is_not_a_learner(tmp_path):
    joined = {"event": "joined", "t": 10.0, "versions": ["0.0"]}
    _write(tmp_path / "decoupled" / "learner-0.jsonl", [joined])
    _write(tmp_path / "decoupled" / "learner-1.jsonl", [{**joined, "t": 12.0}])
    _write(tmp_path / "sync" / "learner-0.jsonl", [{**joined, "t": 50.0}])
    _write(tmp_path / "decoupled" / "events.jsonl", [{"event": "fleet_up", "t": 9.0, "mode": "decoupled"},
                                                     {"event": "joined", "t": 1.0, "mode": "decoupled"}])
    _write(tmp_path / "extra" / "learner-7" / "events.jsonl", [{**joined, "t": 70.0}])
    got = {(s.name, s.group, s.t0) for s in load(tmp_path)}
    assert got == {("decoupled/learner-0", "decoupled", 10.0), ("decoupled/learner-1", "decoupled", 10.0),
                   ("sync/learner-0", "sync", 50.0), ("extra/learner-7", "extra", 70.0)}


def test_staleness_counts_versions_behind_the_newest_any_learner_holds(tmp_path):
    def progress(t: float, accepted: list) -> dict:
        return {"event": "progress", "t": t, "step": 10, "accepted": accepted}

    _write(tmp_path / "a" / "events.jsonl", [
        {"event": "joined", "t": 0.0, "versions": ["0.0", "0.0"]},
        progress(1.0, [[0, 65536, 1], [0, 65536, 2], [1, 65536, 1]]),  # a: fragment 0 at 2, fragment 1 at 1
        progress(3.0, [[1, 65536, 3]]),  # a: (2, 3)
    ])
    _write(tmp_path / "b" / "events.jsonl", [
        {"event": "joined", "t": 0.5, "versions": ["0.0", "0.0"]},
        progress(2.0, [[0, 65536, 1]]),  # b: (1, 0), newest (2, 1)
        {"event": "merged", "t": 2.5, "step": 12, "accepted": [[1, 65536, 2]]},  # b: (1, 2)
        progress(4.0, []),  # b: (1, 2), newest (2, 3)
    ])
    _write(tmp_path / "lonely" / "x" / "events.jsonl", [  # a group of one learner: no staleness to measure
        {"event": "joined", "t": 0.0, "versions": ["0.0"]}, progress(1.0, [])])
    assert sorted(staleness(load(tmp_path))) == sorted([0, 0, 1, 1, 0, 0, 1, 1])
