"""Where a command's settings come from besides its flags: a TOML file (`--config FILE`) and `DILOCO_*`
environment variables.

Precedence, option by option: a flag on the command line > its environment variable > the file > the
option's default. The resolution is generic over the command's click parameters, so an option added to the
command later takes part without more code: its file key is any of its long names (`checkpoint-dir` or
`checkpoint_dir`), its environment variable `DILOCO_` + that name upper-cased with dashes as underscores
(`DILOCO_CHECKPOINT_DIR`). A multiple option takes a TOML list, or from the environment a comma- or
space-separated string. Values go through click's own conversion, so they are checked exactly as flags are;
a value that does not convert, an unknown key or bad TOML is one line naming the file or the variable and
the key. The file and the environment fill the context's `default_map`, which click consults only for
options the command line did not give.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

ENV_PREFIX = "DILOCO_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
SCALARS = (str, int, float, bool)

PRECEDENCE_HELP = (
    "Every option may also come from a TOML file (--config FILE, or DILOCO_CONFIG=FILE) whose keys are the "
    "option names (checkpoint-dir = \"ckpt\", peers = [\"10.0.0.2:7000\"], json = true), or from an environment "
    "variable named DILOCO_ and the option's name in capitals, dashes as underscores (DILOCO_LISTEN, "
    "DILOCO_CHECKPOINT_DIR; DILOCO_PEERS=\"a:7000,b:7000\"). Precedence: a flag > its environment variable > "
    "the file > the default."
)


class ConfigError(click.ClickException):
    """A setting from the file or the environment that cannot be used: one line, no traceback."""


class ConfigCommand(click.Command):
    """A click command whose options may also come from `--config FILE` and `DILOCO_*` variables."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["epilog"] = "\n\n".join(x for x in (kwargs.get("epilog"), PRECEDENCE_HELP) if x)
        super().__init__(*args, **kwargs)
        self.params.append(click.Option(
            ["--config"], type=click.Path(dir_okay=False, path_type=Path), default=None, is_eager=True,
            expose_value=False, callback=_apply, help="TOML file of this command's options (see below)."))


def _apply(ctx: click.Context, param: click.Parameter, value: Path | None) -> None:
    """The `--config` callback (eager, so it runs before every other option is read)."""
    if ctx.resilient_parsing:
        return
    path = value if value is not None else (Path(os.environ[CONFIG_ENV]) if os.environ.get(CONFIG_ENV) else None)
    ctx.default_map = {**(ctx.default_map or {}), **resolve(ctx, path, os.environ)}


def option_keys(command: click.Command) -> dict[str, click.Option]:
    """Every accepted key, normalized (dashes as underscores), and the option it sets."""
    keys: dict[str, click.Option] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or not param.expose_value:
            continue
        for opt in param.opts:
            if opt.startswith("--"):
                keys[_norm(opt[2:])] = param
    return keys


def env_names(param: click.Option) -> list[str]:
    """The environment variables that set `param`: one per long name."""
    return [ENV_PREFIX + _norm(opt[2:]).upper() for opt in param.opts if opt.startswith("--")]


def resolve(ctx: click.Context, path: Path | None, environ: Mapping[str, str]) -> dict[str, Any]:
    """param name -> converted value, from the file under the environment (the environment wins)."""
    return {**(from_file(ctx, path) if path is not None else {}), **from_env(ctx, environ)}


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path.expanduser(), "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"config {path}: cannot read it: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path}: not valid TOML: {e}") from None


def from_file(ctx: click.Context, path: Path) -> dict[str, Any]:
    keys = option_keys(ctx.command)
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # param name -> the key that set it
    for key, value in read_toml(path).items():
        param = keys.get(_norm(key))
        if param is None:
            close = difflib.get_close_matches(_norm(key), keys, n=1)
            hint = f" (did you mean {close[0].replace('_', '-')!r}?)" if close else ""
            raise ConfigError(f"config {path}: unknown key {key!r}{hint}")
        if param.name in given:
            raise ConfigError(f"config {path}: keys {given[param.name]!r} and {key!r} set the same option")
        given[param.name] = key
        out[param.name] = convert(ctx, param, value, f"config {path}: key {key!r}")
    return out


def from_env(ctx: click.Context, environ: Mapping[str, str]) -> dict[str, Any]:
    """Unset or empty variables are skipped; variables that name no option are not read at all."""
    out: dict[str, Any] = {}
    for param in dict.fromkeys(option_keys(ctx.command).values()):
        for name in env_names(param):
            raw = environ.get(name, "")
            if raw.strip():
                value: Any = [v for v in re.split(r"[,\s]+", raw.strip()) if v] if param.multiple else raw
                out[param.name] = convert(ctx, param, value, f"environment variable {name}")
                break
    return out


def convert(ctx: click.Context, param: click.Option, value: Any, where: str) -> Any:
    """`value` through the option's click type, as a flag's would be; a ConfigError saying `where` if not."""
    if param.multiple:
        value = value if isinstance(value, list) else [value]
        bad = next((v for v in value if not isinstance(v, SCALARS)), None)
        if bad is not None:
            raise ConfigError(f"{where}: expected a list of values, found {_kind(bad)} in it")
    elif not isinstance(value, SCALARS):
        raise ConfigError(f"{where}: expected one value, not {_kind(value)}")
    for v in value if param.multiple else [value]:
        if not _fits(param.type, v):
            raise ConfigError(f"{where}: {v!r} is not a valid {param.type.name}")
    try:
        return param.type_cast_value(ctx, value)
    except click.BadParameter as e:
        raise ConfigError(f"{where}: {e.message.rstrip('.')}") from None


def _fits(kind: click.ParamType, value: Any) -> bool:
    """TOML's typed values where click would coerce them silently: true is no integer, 1.5 no integer."""
    if isinstance(value, bool):
        return isinstance(kind, click.types.BoolParamType)
    if isinstance(value, float):
        return not isinstance(kind, (click.types.IntParamType, click.types.BoolParamType))
    return True


def _kind(value: Any) -> str:
    return "a table" if isinstance(value, dict) else "a list" if isinstance(value, list) else type(value).__name__


def _norm(name: str) -> str:
    return name.replace("-", "_").lower()


def child_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without any `DILOCO_*` variable: for the `join` processes the demo and the chaos harness
    start, whose every setting is theirs to choose (a user's DILOCO_PEERS must not reach them)."""
    return {k: v for k, v in environ.items() if not k.startswith(ENV_PREFIX)}
