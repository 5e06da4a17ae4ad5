"""`join`'s settings from a TOML file and DILOCO_* variables (node/config.py): flag > env > file > default.

The real `join` command's parameters are resolved with click's `make_context` (parsing and every callback,
without running the join), so these tests see exactly what `diloco-node join` would be called with."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from diloco.node.cli import join, main
from diloco.node.config import ConfigCommand, ConfigError, child_env


@pytest.fixture
def spec(tmp_path) -> Path:
    path = tmp_path / "run.spec"
    path.write_bytes(b"(only its existence is checked while parsing)")
    return path


@pytest.fixture(autouse=True)
def no_diloco_env(monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith("DILOCO_"):
            monkeypatch.delenv(name)


def params(*args: str) -> dict:
    return join.make_context("join", list(args)).params


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "join.toml"
    path.write_text(text)
    return path


FILE = """
run = "{spec}"
listen = "127.0.0.1:7100"
peers = ["10.0.0.1:7000", "10.0.0.2:7000"]
json = true
checkpoint-dir = "from-file"
"""


def test_a_scalar_a_multiple_option_and_a_flag_each_take_the_first_source_that_has_them(tmp_path, spec,
                                                                                       monkeypatch):
    conf = write(tmp_path, FILE.format(spec=spec))
    assert params("--run", str(spec))["listen"] == "0.0.0.0:7000"  # the default
    assert params("--run", str(spec))["peers"] == () and params("--run", str(spec))["as_json"] is False

    got = params("--config", str(conf))  # the file over the defaults
    assert got["run_path"] == spec and got["listen"] == "127.0.0.1:7100"
    assert got["peers"] == ("10.0.0.1:7000", "10.0.0.2:7000") and got["as_json"] is True
    assert got["checkpoint_dir"] == Path("from-file") and got["steps"] == 0  # (not in the file: its default)

    monkeypatch.setenv("DILOCO_LISTEN", "127.0.0.1:7200")  # the environment over the file
    monkeypatch.setenv("DILOCO_PEERS", "10.0.0.3:7000, 10.0.0.4:7000 10.0.0.5:7000")
    monkeypatch.setenv("DILOCO_JSON", "false")
    got = params("--config", str(conf))
    assert got["listen"] == "127.0.0.1:7200" and got["as_json"] is False
    assert got["peers"] == ("10.0.0.3:7000", "10.0.0.4:7000", "10.0.0.5:7000")

    got = params("--config", str(conf), "--listen", "127.0.0.1:7300", "--peers", "10.0.0.9:7000", "--json")
    assert got["listen"] == "127.0.0.1:7300" and got["peers"] == ("10.0.0.9:7000",) and got["as_json"] is True


def test_the_file_may_come_from_the_environment_and_keys_take_dashes_or_underscores(tmp_path, spec, monkeypatch):
    conf = write(tmp_path, f'spec = "{spec}"\ncheckpoint_every = 50\nwait-for-peers = 3\n')
    monkeypatch.setenv("DILOCO_CONFIG", str(conf))
    got = params()
    assert got["run_path"] == spec and got["checkpoint_every"] == 50 and got["wait_for_peers"] == 3.0


def test_an_unknown_key_is_named_with_the_closest_option(tmp_path, spec):
    conf = write(tmp_path, f'run = "{spec}"\nlistne = "127.0.0.1:0"\n')
    with pytest.raises(ConfigError, match=r"^config .*join\.toml: unknown key 'listne' \(did you mean 'listen'\?\)$"):
        params("--config", str(conf))
    conf = write(tmp_path, 'zzzz = 1\n')
    with pytest.raises(ConfigError, match=r"unknown key 'zzzz'$"):
        params("--config", str(conf))


@pytest.mark.parametrize("line, message", [
    ('steps = "ten"', "key 'steps': 'ten' is not a valid integer"),
    ("steps = 1.5", "key 'steps': 1.5 is not a valid integer"),
    ("steps = true", "key 'steps': True is not a valid integer"),
    ('device = "tpu"', "key 'device': 'tpu' is not one of 'cpu', 'cuda'"),
    ('listen = ["a:1", "b:2"]', "key 'listen': expected one value, not a list"),
    ('peers = [["a:1"]]', "key 'peers': expected a list of values, found a list in it"),
    ('wait-for-peers = -1', "key 'wait-for-peers': -1.0 is not in the range x>=0"),
    ('run = "/nonexistent.spec"', "key 'run': File '/nonexistent.spec' does not exist"),
])
def test_a_value_of_the_wrong_type_names_the_file_and_the_key(tmp_path, spec, line, message):
    conf = write(tmp_path, f"{line}\n" if line.startswith("run") else f'run = "{spec}"\n{line}\n')
    with pytest.raises(ConfigError) as e:
        params("--config", str(conf))
    assert e.value.message == f"config {conf}: {message}"


def test_bad_toml_a_missing_file_and_two_keys_for_one_option(tmp_path, spec):
    conf = write(tmp_path, "steps = = 3\n")
    with pytest.raises(ConfigError, match=r"^config .*join\.toml: not valid TOML: .*line 1"):
        params("--config", str(conf))
    with pytest.raises(ConfigError, match=r"^config .*missing\.toml: cannot read it: No such file"):
        params("--config", str(tmp_path / "missing.toml"))
    conf = write(tmp_path, f'run = "{spec}"\nspec = "{spec}"\n')
    with pytest.raises(ConfigError, match="keys 'run' and 'spec' set the same option"):
        params("--config", str(conf))


def test_a_bad_environment_variable_is_named(spec, monkeypatch):
    monkeypatch.setenv("DILOCO_EVAL_EVERY", "often")
    with pytest.raises(ConfigError) as e:
        params("--run", str(spec))
    assert e.value.message == "environment variable DILOCO_EVAL_EVERY: 'often' is not a valid integer"
    monkeypatch.setenv("DILOCO_EVAL_EVERY", "")  # empty: unset
    assert params("--run", str(spec))["eval_every"] == 0


def test_an_option_added_later_takes_part_without_more_code(tmp_path, monkeypatch):
    @click.command(cls=ConfigCommand)
    @click.option("--drain-s", default=30.0, type=float)
    @click.option("--tag", multiple=True)
    def cmd(drain_s: float, tag: tuple[str, ...]) -> None:
        click.echo(f"{drain_s} {','.join(tag)}")

    conf = write(tmp_path, 'drain_s = 5\ntag = "solo"\n')
    assert CliRunner().invoke(cmd, ["--config", str(conf)]).output == "5.0 solo\n"
    monkeypatch.setenv("DILOCO_DRAIN_S", "7.5")
    assert CliRunner().invoke(cmd, ["--config", str(conf)]).output == "7.5 solo\n"
    assert CliRunner().invoke(cmd, ["--config", str(conf), "--drain-s", "1"]).output == "1.0 solo\n"


def test_join_help_explains_the_file_the_variables_and_the_precedence():
    r = CliRunner().invoke(main, ["join", "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "--config FILE" in text and "DILOCO_LISTEN" in text and "DILOCO_PEERS" in text
    assert "Precedence: a flag > its environment variable > the file > the default." in text


def test_the_demo_and_chaos_learners_do_not_inherit_a_users_settings():
    assert child_env({"DILOCO_PEERS": "x:1", "DILOCO_CONFIG": "f", "PATH": "/bin"}) == {"PATH": "/bin"}
