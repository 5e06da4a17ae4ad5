"""Worker of benchmarks/crash_storage.py: `diloco-node join`, with busy markers for the harness to aim at.

    python benchmarks/_crash_storage_worker.py BUSY_DIR join ARGS...

While a checkpoint is being written (`save_checkpoint`, in the learner's writer thread) a file `ckpt-<n>` exists
in BUSY_DIR, and while a replication is sent or received (`Replication.replicate`, `Replication._on_replicate`)
a file `repl-<n>`. A kill -9 leaves them behind: the harness reads what the kill interrupted from them, and
polls them to land kills inside those windows. Nothing else of the learner changes.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

BUSY = Path(sys.argv[1])
_ids = itertools.count()


def _mark(kind: str) -> Path:
    path = BUSY / f"{kind}-{os.getpid()}-{next(_ids)}"
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    return path


def _sync_marked(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        path = _mark(kind)
        try:
            return fn(*args, **kwargs)
        finally:
            path.unlink(missing_ok=True)

    return wrapper


def _async_marked(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        path = _mark(kind)
        try:
            return await fn(*args, **kwargs)
        finally:
            path.unlink(missing_ok=True)

    return wrapper


def main() -> None:
    BUSY.mkdir(parents=True, exist_ok=True)
    from diloco.coordinator import replication
    from diloco.node import cli, learner

    learner.save_checkpoint = _sync_marked("ckpt", learner.save_checkpoint)  # (the name `Learner` calls)
    cls = replication.Replication
    cls.replicate = _async_marked("repl", cls.replicate)
    cls._on_replicate = _async_marked("repl", cls._on_replicate)  # (bound when the route is added, after this)
    sys.argv = ["diloco-node", *sys.argv[2:]]
    cli.main()


if __name__ == "__main__":
    main()
