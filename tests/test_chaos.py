"""Chaos runs for real: learner processes killed with SIGKILL on a schedule, in both modes (DESIGN §8)."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from diloco.node.chaos_run import RESULT_KEYS, ChaosOptions, run_chaos
from diloco.node.cli import main


def _no_learner_left(out) -> None:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out) not in ps, "a learner process of this run is still alive"


def _assert_invariants(mode: dict) -> None:
    assert mode["version_regressions"] == 0
    assert mode["unloadable_checkpoints"] == 0
    assert mode["lost_accepted_updates"] == 0
    assert mode["unexpected_exits"] == 0, "a learner died on its own (see its log in the output folder)"


@pytest.mark.timeout(120)
def test_a_short_decoupled_chaos_run_restarts_killed_learners_and_keeps_every_invariant(tmp_path):
    opts = ChaosOptions(peers=3, minutes=0.4, mtbf_s=15.0, downtime_s=1.0, seed=1, out=tmp_path, calibrate_s=8.0,
                        checkpoint_every=40, eval_every=40, no_failure=False, mode="decoupled", owner_every=2,
                        stragglers={1: 1.5}, throttle={2: 20.0})
    result = run_chaos(opts, say=lambda _: None)
    _no_learner_left(tmp_path)
    mode = result["decoupled"]
    assert mode["failures"] >= 2, "the schedule killed fewer than two learners"
    _assert_invariants(mode)
    assert 0.3 < mode["goodput"] <= 1.05 and mode["merged_tokens"] > 0
    events = [json.loads(line) for line in (tmp_path / "decoupled" / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "fault" and e["owner_of"] is not None for e in events), "no owner was killed"
    assert sum(e["event"] == "launch" for e in events) > opts.peers, "killed learners were restarted"
    link = next(e for e in events if e["event"] == "throttled_link")
    assert link["slot"] == 2 and link["forwarded_bytes"] > 0, "nobody reached learner 2 through its throttled link"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_short_chaos_run_keeps_every_invariant_in_both_modes(tmp_path):
    opts = ChaosOptions(peers=3, minutes=0.5, mtbf_s=20.0, downtime_s=2.0, seed=1, out=tmp_path, calibrate_s=6.0,
                        checkpoint_every=40, eval_every=40, no_failure=False)
    result = run_chaos(opts, say=lambda _: None)
    _no_learner_left(tmp_path)
    for name in ("decoupled", "sync"):
        mode = result[name]
        assert set(RESULT_KEYS) <= set(mode)
        assert mode["failures"] >= 1, "the schedule killed nobody"
        _assert_invariants(mode)
        assert 0 < mode["goodput"] <= 1.05 and mode["merged_tokens"] > 0
    assert result["sync"]["aborts"] == result["sync"]["failures"], "every sync failure rolls the whole job back"
    events = [json.loads(line) for line in (tmp_path / "decoupled" / "events.jsonl").read_text().splitlines()]
    kills = [e for e in events if e["event"] == "kill" and e["why"] == "fault"]
    launches = [e for e in events if e["event"] == "launch"]
    assert kills and len(launches) > opts.peers, "killed learners were restarted"
    assert (tmp_path / "schedule.json").exists() and (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_chaos_command_prints_its_json_and_plots(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "diloco.node.cli", "chaos", "--peers", "3", "--minutes", "0.75", "--mtbf", "40",
         "--downtime", "3", "--checkpoint-every", "50", "--out", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {"decoupled", "sync", "no_failure_eval_loss"}
    for name in ("decoupled", "sync"):
        assert set(result[name]) == {*RESULT_KEYS, "predicted_goodput"}
        assert result[name]["version_regressions"] == result[name]["lost_accepted_updates"] == 0
        assert result[name]["unloadable_checkpoints"] == 0
    assert (tmp_path / "loss_vs_time.png").stat().st_size > 0 and (tmp_path / "goodput_vs_time.png").exists()
    _no_learner_left(tmp_path)


def test_chaos_refuses_a_malformed_straggler_with_one_line():
    r = CliRunner().invoke(main, ["chaos", "--straggler", "fast"])
    assert r.exit_code != 0 and "SLOT:FACTOR" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["chaos", "--peers", "3", "--straggler", "7:2"])
    assert r.exit_code != 0 and "SLOT must be 0..2" in r.output


def test_the_throttle_relay_forwards_both_ways_at_its_rate():
    import socket
    import threading
    import time

    from diloco.node.chaos import _free_port
    from diloco.node.throttle import ThrottleRelay

    server = socket.create_server(("127.0.0.1", 0))
    target = server.getsockname()[1]

    def echo():
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    relay = ThrottleRelay(_free_port(), target, rate_bytes_s=1_000_000).start()
    try:
        payload = bytes(range(256)) * 2048  # 512 KiB each way, at 1 MB/s after a 64 KiB burst
        with socket.create_connection(("127.0.0.1", relay.port)) as c:
            t0 = time.monotonic()
            threading.Thread(target=c.sendall, args=(payload,), daemon=True).start()
            got = bytearray()
            while len(got) < len(payload):
                got += c.recv(65536)
            elapsed = time.monotonic() - t0
        assert bytes(got) == payload
        assert 0.4 < elapsed < 2.0, f"512 KiB through a 1 MB/s link took {elapsed:.2f} s"
    finally:
        relay.stop()
        server.close()
