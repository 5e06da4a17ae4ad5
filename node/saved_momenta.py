"""The outer momenta a peer holds, saved with its checkpoint (docs/architecture.md §5.6).

Only owners and replicas hold a fragment's outer momentum, in memory. When every member stops at once (a
synchronous job's restart, a whole fleet preempted), no live copy is left, and each new owner would wait for a
pull nobody can answer and then start its momentum from zero. So a checkpoint also saves, per fragment, the
momentum this peer held and the version it belongs to, as the bytes it is kept in (the run's codec as it was
replicated, or fp32 for an owner's own): ``extra/momentum/<p>`` (uint8) and ``meta["momenta"]["<p>"] =
{"label": [term, version], "meta": codec meta}``. On restart they are kept as a replica would keep them; a new
owner uses one only if its version is the fragment's current one (`coordinator/takeover.py`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from diloco.coordinator.fragments import Encoded
from diloco.coordinator.version import Version
from diloco.protocol.codecs import get_codec
from diloco.protocol.errors import ProtocolError

from .checkpoint import Checkpoint

log = logging.getLogger(__name__)
META_KEY = "momenta"
PREFIX = "momentum/"


def add_to(ckpt: Checkpoint, held: dict[int, tuple[Version, Encoded]]) -> None:
    """Put `held` (`Swarm.held_momenta`) into `ckpt`'s extra tensors and meta."""
    entries = {}
    for p, (label, momentum) in sorted(held.items()):
        ckpt.extra_tensors[f"{PREFIX}{p}"] = torch.from_numpy(np.frombuffer(momentum.payload, np.uint8).copy())
        entries[str(p)] = {"label": [label.term, label.version], "meta": momentum.meta}
    ckpt.meta[META_KEY] = entries


def read_from(ckpt: Checkpoint, codec_name: str, numels: list[int]) -> dict[int, tuple[Version, Encoded]]:
    """The momenta `ckpt` saved, each checked by decoding it: one that does not fit this run (another codec,
    size or fragment count) is left out with a warning, never half-used."""
    out: dict[int, tuple[Version, Encoded]] = {}
    entries = ckpt.meta.get(META_KEY)
    for key, entry in (entries.items() if isinstance(entries, dict) else ()):
        try:
            p = int(key)
            if not isinstance(entry, dict):
                raise ValueError(f"entry of fragment {key!r} is not an object")
            out[p] = checked(p, entry["label"], entry["meta"], ckpt.extra_tensors[f"{PREFIX}{p}"], codec_name,
                             numels)
        except (KeyError, TypeError, ValueError, ProtocolError) as e:
            log.warning("checkpoint momentum of fragment %s left out: %s", key, e)
    return out


def checked(p: int, label: object, meta: object, payload: torch.Tensor, codec_name: str,
            numels: list[int]) -> tuple[Version, Encoded]:
    """A saved momentum (checkpoint or version journal) as a replica keeps it, once it decodes to fragment p
    of this run; raises ValueError, KeyError, TypeError or ProtocolError otherwise."""
    if not 0 <= p < len(numels):
        raise ValueError(f"fragment {p} is not one of this run's {len(numels)}")
    term, version = label  # type: ignore[misc]
    name = meta.get("codec") if isinstance(meta, dict) else None
    if name not in (codec_name, "fp32"):
        raise ValueError(f"codec {name!r}, this run's momentum is {codec_name!r} or fp32")
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"payload is {payload.dtype}{list(payload.shape)}, not flat uint8")
    momentum = Encoded(get_codec(name), meta, memoryview(payload.numpy()))
    momentum.decode(numels[p])  # refuses a wrong size or a non-finite value
    return Version(int(term), int(version)), momentum
