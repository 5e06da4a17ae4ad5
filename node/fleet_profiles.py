"""Named parameter sets of the fleet simulator: which model a fleet follows, and at what costs.

- `paper` (the default of `diloco-node simulate`): Decoupled DiLoCo's own simulation setup (arXiv:2604.21428),
  learners that are large elastic jobs of TPU slices: `node/simulate_elastic.py`, `ElasticParams`. Every value
  and its source: the field comments there and docs/chaos.md.
- `localhost`: a learner is one process, so any failure stops all of it, as in the chaos harness (docs/chaos.md):
  `node/simulate_restart.py`, `SimParams`, with the costs this simulator used before the paper profile.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields, replace

from .simulate_elastic import ElasticParams
from .simulate_restart import SimParams

Params = ElasticParams | SimParams
PROFILES: dict[str, Params] = {"paper": ElasticParams(), "localhost": SimParams()}
DEFAULT_PROFILE = "paper"


def profile(name: str) -> Params:
    """The named parameter set; ValueError with the known names otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, not {name!r}") from None


def with_overrides(params: Params, items: Iterable[str]) -> Params:
    """Apply NAME=VALUE strings (the CLI's --param) to a parameter set; ValueError with a one-line reason."""
    names = {f.name: f.type for f in fields(params)}
    changes: dict[str, float | int] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in names:
            raise ValueError(f"--param {item!r}: expected NAME=VALUE with NAME one of {', '.join(names)}")
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"--param {item!r}: {text!r} is not a number") from None
        if names[name] == "int":
            if not value.is_integer():
                raise ValueError(f"--param {item!r}: {name} must be a whole number")
            value = int(value)
        changes[name] = value
    return replace(params, **changes)
