"""The learner: Python API, training loop glue, built-in tasks, checkpoints, CLI.

    from diloco.node import Learner, SwarmConfig, create_run

Names are imported on first use, so `diloco-node --help` or a bootstrap-only `diloco-node dht` never loads torch.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["JoinError", "Learner", "RunMismatch", "SwarmConfig", "SwarmFailed", "__version__", "create_run"]

_LAZY = {"Learner": "learner", "RunMismatch": "learner", "create_run": "learner", "JoinError": "swarm",
         "SwarmConfig": "swarm", "SwarmFailed": "swarm"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
