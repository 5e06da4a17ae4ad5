"""Mistakes a user can make with `diloco-node join`, each through the real CLI in its own process: a non-zero
exit and exactly one `Error: ...` line on stderr, never a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from diloco.node.cli import main

from .helpers import REPO, Proc, cli


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two signed run specs (different names, so different run ids) and their creator's key."""
    d = tmp_path_factory.mktemp("runs")
    out = {}
    for name in ("a", "b"):
        out[name] = d / f"{name}.spec"
        r = CliRunner().invoke(main, ["init-run", "--name", name, "--key", str(d / "creator.key"),
                                      "--out", str(out[name]), "--inner-steps", "10"])
        assert r.exit_code == 0, r.output
    return out


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**clean, "PYTHONUNBUFFERED": "1", **(env or {})})


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """The single `Error: ...` line of a failed run (asserted: nothing else on stderr, no traceback)."""
    assert r.returncode not in (0, None), f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    return lines[0]


def test_a_port_in_use_names_the_port_and_what_to_do(runs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = one_error_line(run_cli("join", "--run", str(runs["a"]), "--listen", f"127.0.0.1:{port}",
                                      "--steps", "1"))
    assert line == f"Error: port 127.0.0.1:{port} is in use (another peer? pick --listen HOST:OTHERPORT)"


def test_an_unreachable_bootstrap_peer_after_waiting_for_it(runs):
    line = one_error_line(run_cli("join", "--run", str(runs["a"]), "--listen", "127.0.0.1:0",
                                  "--peers", "127.0.0.1:1", "--wait-for-peers", "1", "--steps", "1"))
    assert line.startswith("Error: none of the bootstrap peers answered (http://127.0.0.1:1"), line
    assert line.endswith("check --peers (tried for 1 s)"), line


def test_a_run_file_that_is_not_a_signed_spec(runs, tmp_path):
    junk = tmp_path / "junk.spec"
    junk.write_bytes(b"not a spec at all\n")
    line = one_error_line(run_cli("join", "--run", str(junk), "--listen", "127.0.0.1:0"))
    assert line.startswith(f"Error: run spec {junk}: not valid msgpack"), line
    assert line.endswith("pass the file `diloco-node init-run` wrote"), line

    forged = tmp_path / "forged.spec"
    data = bytearray(runs["a"].read_bytes())
    data[data.index(b"markov")] ^= 1
    forged.write_bytes(bytes(data))
    line = one_error_line(run_cli("join", "--run", str(forged), "--listen", "127.0.0.1:0"))
    assert line.startswith(f"Error: run spec {forged}: signature does not verify"), line


@pytest.mark.timeout(120)
def test_peers_of_another_run_are_refused_not_joined_as_a_new_swarm(runs):
    peer = Proc(cli("join", "--run", str(runs["a"]), "--listen", "127.0.0.1:0", "--json", "--steps", "100000"))
    try:
        joined = json.loads(peer.wait_for(r'^\{"event": "joined"', timeout=60).string)
        line = one_error_line(run_cli("join", "--run", str(runs["b"]), "--listen", "127.0.0.1:0",
                                      "--peers", joined["url"], "--steps", "1"))
    finally:
        peer.kill()
    assert line.startswith(f"Error: {joined['url']} refused this run's messages (message is for run "), line
    assert line.endswith("--peers must be peers of the run --run names"), line


def test_a_garbage_key_file_and_one_readable_by_others(runs, tmp_path):
    key = tmp_path / "garbage.pem"
    key.write_text("this is no key\n")
    key.chmod(0o600)
    line = one_error_line(run_cli("join", "--run", str(runs["a"]), "--key", str(key), "--listen", "127.0.0.1:0"))
    assert line.startswith(f"Error: {key} is not an unencrypted PEM private key"), line

    key.chmod(0o644)
    line = one_error_line(run_cli("join", "--run", str(runs["a"]), "--key", str(key), "--listen", "127.0.0.1:0"))
    assert line == f"Error: key file {key} is accessible by group or others (mode 0644); run `chmod 600 {key}`"


def test_a_missing_data_file(runs):
    line = one_error_line(run_cli("join", "--run", str(runs["a"]), "--listen", "127.0.0.1:0",
                                  "--data", "file:/nonexistent", "--steps", "1"))
    assert line == ("Error: --data file:/nonexistent: corpus file '/nonexistent' not found: pass the path of "
                    "an existing text file")


def test_config_file_and_environment_mistakes_name_their_source(runs, tmp_path):
    conf = tmp_path / "join.toml"
    conf.write_text(f'run = "{runs["a"]}"\nlistne = "127.0.0.1:0"\n')
    line = one_error_line(run_cli("join", "--config", str(conf)))
    assert line == f"Error: config {conf}: unknown key 'listne' (did you mean 'listen'?)"

    line = one_error_line(run_cli("join", "--run", str(runs["a"]), env={"DILOCO_STEPS": "ten"}))
    assert line == "Error: environment variable DILOCO_STEPS: 'ten' is not a valid integer"
