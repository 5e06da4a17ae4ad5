from click.testing import CliRunner

from diloco.coordinator.runspec import Genesis
from diloco.node.cli import main


def test_init_run_writes_a_signed_spec_pinned_to_the_task_model(tmp_path):
    out = tmp_path / "run.spec"
    r = CliRunner().invoke(main, ["init-run", "--name", "t", "--key", str(tmp_path / "k.pem"), "--out", str(out),
                                  "--inner-steps", "20", "--codec", "int4"])
    assert r.exit_code == 0, r.output
    g = Genesis.load(out)
    assert g.spec.inner_steps == 20 and g.spec.codec == "int4" and len(g.spec.plan_digest) == 32
    assert r.output.split("run_id: ")[1].split()[0] == g.spec.run_id.hex()


def test_init_run_refuses_an_unknown_codec_in_one_line(tmp_path):
    r = CliRunner().invoke(main, ["init-run", "--name", "t", "--key", str(tmp_path / "k.pem"), "--codec", "zip",
                                  "--out", str(tmp_path / "r.spec")])
    assert r.exit_code == 1 and "unknown codec 'zip'" in r.output and "Traceback" not in r.output


def test_join_with_a_tampered_spec_is_refused_in_one_line(tmp_path):
    out = tmp_path / "run.spec"
    CliRunner().invoke(main, ["init-run", "--name", "t", "--key", str(tmp_path / "k.pem"), "--out", str(out)])
    data = bytearray(out.read_bytes())
    data[data.index(b"markov")] ^= 1
    out.write_bytes(bytes(data))
    r = CliRunner().invoke(main, ["join", "--run", str(out), "--listen", "127.0.0.1:0"])
    assert r.exit_code == 1 and "run spec" in r.output and "Traceback" not in r.output


def test_join_with_an_unreachable_bootstrap_peer_says_so(tmp_path):
    out = tmp_path / "run.spec"
    CliRunner().invoke(main, ["init-run", "--name", "t", "--key", str(tmp_path / "k.pem"), "--out", str(out)])
    r = CliRunner().invoke(main, ["join", "--run", str(out), "--listen", "127.0.0.1:0", "--peers", "127.0.0.1:1",
                                  "--steps", "1"])
    assert r.exit_code == 1 and "bootstrap" in r.output and "--peers" in r.output


def test_join_with_fsdp_outside_torchrun_says_how_to_start_it(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run.spec"
    CliRunner().invoke(main, ["init-run", "--name", "t", "--key", str(tmp_path / "k.pem"), "--out", str(out)])
    r = CliRunner().invoke(main, ["join", "--run", str(out), "--listen", "127.0.0.1:0", "--fsdp", "--steps", "1"])
    assert r.exit_code == 1 and "torchrun --nproc-per-node" in r.output and "Traceback" not in r.output
