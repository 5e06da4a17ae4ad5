"""Local checkpoints: safetensors + a JSON manifest with digests, written atomically (docs/architecture.md §5.6).

A checkpoint is either whole and verified or not loaded at all: a truncated, corrupted or edited one is detected
by digest and refused, and `load_latest` falls back to the next older valid one. Nothing here ever pickles (no
torch.save / torch.load): tensors go into safetensors, everything else into JSON.

On-disk format, version 1::

    DIR/
      step-<t>/                   one folder per saved inner step t (decimal, no padding); the newest `keep` stay
        tensors.safetensors       every tensor, under a namespaced name:
                                    param/<name>      model.state_dict() entries (parameters and buffers)
                                    optim/<i>/<key>   tensor state of the optimizer's parameter index i
                                    group/<g>/<key>   tensor-valued hyperparameter of param group g (e.g. lr)
                                    anchor/<p>        anchor Θ_p of fragment p
                                    extra/<name>      the caller's extra tensors (e.g. momentum of owned shards)
        manifest.json             {"format": "diloco-checkpoint", "format_version": 1, "step": t,
                                   "tensors_sha256": SHA-256 (hex) of tensors.safetensors,
                                   "tensors": {name: {"shape": [..], "dtype": "float32"}},
                                   "optimizer": {"state": {"<i>": {key: JSON scalar}},
                                                 "param_groups": [{hyperparameter: JSON value, "params": [i..]}]},
                                   "labels": {"<p>": [term, version]}, "certs": {"<p>": hex of the cert bytes},
                                   "counters": {..}, "meta": {..} (a learner's: run_id, peer_id,
                                   wall_time, peers: the member URLs it saw),
                                   "manifest_sha256": SHA-256 (hex) of the canonical JSON of all other keys}
      .tmp-<random>/              a write in progress or a crashed one: never read, removed by the next save
      .replaced-<t>/              step-<t> moved aside while a new step-<t> replaces it: read only if step-<t> is
                                  missing or invalid (killed between the two renames), removed by the next save

Writing: both files go into `DIR/.tmp-<random>/`, each file and that folder are fsynced, the folder is renamed to
`step-<t>` (atomic on POSIX) and `DIR` is fsynced. There is no LATEST pointer: the latest checkpoint is found by
scanning the `step-*` folders, highest step first, and taking the first that verifies. Loading verifies that the
manifest parses and matches `manifest_sha256`, that the tensors file matches `tensors_sha256`, and that it holds
exactly the listed tensors with the recorded shape and dtype. `counters` and `meta` go through JSON (int keys come
back as strings, tuples as lists). Folders are 0700 and files 0600. One writer per DIR.

A failed write (a full disk: ENOSPC) raises and leaves every older checkpoint as it was: nothing outside the
temporary folder changes before both files are on disk. Pruning keeps the new checkpoint and the `keep` − 1
newest ones below its step; a folder of a higher step (one a resume fell back from) is left alone A pruned
folder is renamed to `.tmp-<random>` before it is deleted, so a kill mid-delete never leaves a half `step-<t>`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

log = logging.getLogger(__name__)

FORMAT, FORMAT_VERSION = "diloco-checkpoint", 1
TENSORS, MANIFEST = "tensors.safetensors", "manifest.json"
_STEP_DIR = re.compile(r"step-(0|[1-9][0-9]*)")
_REPLACED_DIR = re.compile(r"\.replaced-(0|[1-9][0-9]*)")
_SCALARS = (type(None), bool, int, float, str)


class CheckpointCorrupt(Exception):
    """A checkpoint that failed verification; `reason` names the check that failed."""

    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


@dataclass
class Checkpoint:
    """Everything a learner needs to resume at inner step `step`."""

    step: int
    params: dict[str, Tensor]
    optimizer: dict  # a state_dict for optimizer.load_state_dict, tensors included
    anchors: dict[int, Tensor] = field(default_factory=dict)
    labels: dict[int, tuple[int, int]] = field(default_factory=dict)  # p -> (term, version)
    certs: dict[int, bytes] = field(default_factory=dict)  # p -> owner-signed version certificate
    counters: dict = field(default_factory=dict)
    extra_tensors: dict[str, Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


def save_checkpoint(directory: str | os.PathLike, ckpt: Checkpoint, *, keep: int = 2) -> Path:
    """Write `ckpt` atomically as `directory/step-<step>/` (replacing one of the same step), keep the newest `keep`."""
    if keep < 1:
        raise ValueError("keep must be at least 1")
    tensors, manifest = _encode(ckpt)  # raises TypeError before anything touches the disk
    root = Path(directory)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    _tidy(root)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    final, replaced = root / f"step-{manifest['step']}", None
    try:
        save_file(_storable(tensors), tmp / TENSORS)
        os.chmod(tmp / TENSORS, 0o600)
        manifest["tensors_sha256"] = _sha256(tmp / TENSORS, fsync=True)
        manifest["manifest_sha256"] = _manifest_digest(manifest)
        fd = os.open(tmp / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(manifest, indent=1).encode())
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # aside under a name `load_latest` still reads until the new one is in place
            replaced = root / f".replaced-{manifest['step']}"
            shutil.rmtree(replaced, ignore_errors=True)
            os.rename(final, replaced)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if replaced is not None and not final.exists() and replaced.exists():
            os.rename(replaced, final)  # (a rename frees space, it needs none)
        raise
    older = [p for p in _step_dirs(root) if _step_of(p) < int(manifest["step"])]
    for old in older[keep - 1 :] + [replaced]:
        if old is not None:
            _remove(root, old)
    _fsync_dir(root)
    return final


def _remove(root: Path, path: Path) -> None:
    """Rename to `.tmp-<random>` first, then delete: a kill in the middle of the delete leaves a temporary
    folder (removed by the next save), never a half-deleted `step-<t>`."""
    trash = root / f".tmp-{secrets.token_hex(8)}"
    try:
        os.rename(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _tidy(root: Path) -> None:
    """Before a save: drop crashed writes; put back a `.replaced-<t>` whose new `step-<t>` never arrived."""
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for aside in root.glob(".replaced-*"):
        m = _REPLACED_DIR.fullmatch(aside.name)
        final = root / f"step-{m[1]}" if m else None
        if final is not None and not final.exists():
            os.rename(aside, final)
        else:
            shutil.rmtree(aside, ignore_errors=True)


def load_latest(directory: str | os.PathLike) -> Checkpoint | None:
    """The newest checkpoint under `directory` that verifies; invalid ones are skipped with a warning. A
    `.replaced-<t>` (kill -9 between the two renames of a same-step replacement) counts as step t, after
    `step-<t>`."""
    for path in _candidates(Path(directory)):
        try:
            return load_checkpoint(path)
        except CheckpointCorrupt as e:
            log.warning("skipping invalid checkpoint %s: %s", e.path, e.reason)
    return None


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Load and verify one `step-<t>` folder; raises CheckpointCorrupt unless every check passes."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointCorrupt(path, f"manifest unreadable: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorrupt(path, "not a checkpoint manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointCorrupt(path, f"unsupported format version {manifest.get('format_version')!r}")
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise CheckpointCorrupt(path, "manifest digest mismatch (edited or corrupted)")
    try:
        digest = _sha256(path / TENSORS)
    except OSError as e:
        raise CheckpointCorrupt(path, f"tensors file unreadable: {e}") from e
    if digest != manifest.get("tensors_sha256"):
        raise CheckpointCorrupt(path, "tensors file digest mismatch (truncated or corrupted)")
    named = _STEP_DIR.fullmatch(path.name) or _REPLACED_DIR.fullmatch(path.name)
    if named and int(named[1]) != manifest.get("step"):
        raise CheckpointCorrupt(path, f"folder says step {named[1]}, manifest says {manifest.get('step')!r}")
    try:
        tensors = load_file(path / TENSORS)
        listed = manifest["tensors"]
        if set(tensors) != set(listed):
            raise CheckpointCorrupt(path, "tensor names differ from the manifest")
        for name, spec in listed.items():
            if list(tensors[name].shape) != spec["shape"] or _dtype_name(tensors[name].dtype) != spec["dtype"]:
                raise CheckpointCorrupt(path, f"tensor {name} differs from its recorded shape/dtype")
        return _decode(manifest, tensors)
    except CheckpointCorrupt:
        raise
    except Exception as e:  # a digest-valid file that still does not decode: refuse it, never half-load it
        raise CheckpointCorrupt(path, f"undecodable: {type(e).__name__}: {e}") from e


def capture(model: torch.nn.Module | Mapping[str, Tensor], optimizer: torch.optim.Optimizer | None, *, step: int,
            **rest: Any) -> Checkpoint:
    """A snapshot of `model` (a module, or its state_dict) and `optimizer` (cloned, so training may go on while
    it is written) plus `rest`."""
    sd = optimizer.state_dict() if optimizer is not None else {"state": {}, "param_groups": []}
    optim = {
        "state": {i: {k: _clone(v) for k, v in s.items()} for i, s in sd["state"].items()},
        "param_groups": [{k: _clone(v) for k, v in g.items()} for g in sd["param_groups"]],
    }
    for key in ("anchors", "extra_tensors"):
        if key in rest:
            rest[key] = {k: _clone(v) for k, v in rest[key].items()}
    params = {k: _clone(v) for k, v in _state_of(model).items()}
    return Checkpoint(step=step, params=params, optimizer=optim, **rest)


def restore(ckpt: Checkpoint, model: torch.nn.Module | Mapping[str, Tensor],
            optimizer: torch.optim.Optimizer | None) -> None:
    """Copy the checkpoint into `model` (a module, or its state_dict) in place (no reallocation) and load the
    optimizer state.

    The optimizer keeps its own param_groups structure; saved hyperparameters overwrite it (lists back to tuples
    where the optimizer had tuples, e.g. AdamW's betas). Nothing is changed unless every tensor fits.
    """
    live = _state_of(model)
    if set(live) != set(ckpt.params):
        missing, unexpected = sorted(set(live) - set(ckpt.params)), sorted(set(ckpt.params) - set(live))
        raise KeyError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    for name, t in ckpt.params.items():
        if live[name].shape != t.shape or live[name].dtype != t.dtype:
            raise ValueError(f"{name}: checkpoint has {t.dtype}{list(t.shape)}, model has "
                             f"{live[name].dtype}{list(live[name].shape)}")
    if not ckpt.optimizer["param_groups"] and not ckpt.optimizer["state"]:
        optimizer = None  # saved without an optimizer (an FSDP2 learner's, before they were gathered): keep it
    if optimizer is not None and len(optimizer.param_groups) != len(ckpt.optimizer["param_groups"]):
        raise ValueError("checkpoint and optimizer have different numbers of param groups")
    with torch.no_grad():
        for name, t in ckpt.params.items():
            live[name].copy_(t)
    if optimizer is None:
        return
    groups = []
    for current, saved in zip(optimizer.param_groups, ckpt.optimizer["param_groups"], strict=True):
        merged = {k: v for k, v in current.items() if k != "params"}
        for k, v in saved.items():
            merged[k] = tuple(v) if isinstance(current.get(k), tuple) and isinstance(v, list) else _clone(v)
        groups.append(merged)
    # load_state_dict keeps same-device tensors by reference: clone so training never mutates `ckpt`
    state = {i: {k: _clone(v) for k, v in s.items()} for i, s in ckpt.optimizer["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _state_of(model: torch.nn.Module | Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    return model if isinstance(model, Mapping) else model.state_dict()


def _encode(ckpt: Checkpoint) -> tuple[dict[str, Tensor], dict]:
    tensors = {f"param/{k}": v for k, v in ckpt.params.items()}
    tensors |= {f"anchor/{int(p)}": v for p, v in ckpt.anchors.items()}
    tensors |= {f"extra/{k}": v for k, v in ckpt.extra_tensors.items()}
    state: dict[str, dict] = {}
    for i, entry in ckpt.optimizer.get("state", {}).items():
        state[str(int(i))] = {}
        for key, value in entry.items():
            if isinstance(value, Tensor) and isinstance(key, str):
                tensors[f"optim/{int(i)}/{key}"] = value
            elif isinstance(value, _SCALARS) and isinstance(key, str):
                state[str(int(i))][key] = value
            else:
                raise TypeError(f"optimizer state[{i}][{key!r}] is a {type(value).__name__}: only tensors and "
                                "JSON scalars (None, bool, int, float, str) under str keys can be checkpointed")
    groups: list[dict] = []
    for g, group in enumerate(ckpt.optimizer.get("param_groups", [])):
        groups.append({})
        for key, value in group.items():
            if isinstance(value, Tensor):
                tensors[f"group/{g}/{key}"] = value
            elif _is_json(value):
                groups[g][key] = value
            else:
                raise TypeError(f"param_groups[{g}][{key!r}] is a {type(value).__name__}: only tensors and "
                                "JSON values can be checkpointed")
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "step": int(ckpt.step),
        "tensors": {n: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)} for n, t in tensors.items()},
        "optimizer": {"state": state, "param_groups": groups},
        "labels": {str(int(p)): [int(term), int(version)] for p, (term, version) in ckpt.labels.items()},
        "certs": {str(int(p)): bytes(cert).hex() for p, cert in ckpt.certs.items()},
        "counters": ckpt.counters, "meta": ckpt.meta,
    }
    _canonical(manifest)  # counters/meta that JSON cannot hold fail here with json's TypeError
    return tensors, manifest


def _decode(manifest: dict, tensors: dict[str, Tensor]) -> Checkpoint:
    state = {int(i): dict(entry) for i, entry in manifest["optimizer"]["state"].items()}
    groups = [dict(g) for g in manifest["optimizer"]["param_groups"]]
    params, anchors, extra = {}, {}, {}
    for name in manifest["tensors"]:  # manifest order is the order they were given in
        kind, _, rest = name.partition("/")
        if kind in ("optim", "group"):
            index, _, key = rest.partition("/")
            (state.setdefault(int(index), {}) if kind == "optim" else groups[int(index)])[key] = tensors[name]
        else:  # an unknown namespace is a KeyError, hence CheckpointCorrupt
            target = {"param": params, "anchor": anchors, "extra": extra}[kind]
            target[int(rest) if kind == "anchor" else rest] = tensors[name]
    return Checkpoint(
        step=manifest["step"], params=params, optimizer={"state": state, "param_groups": groups},
        anchors=anchors, labels={int(p): (int(t), int(v)) for p, (t, v) in manifest["labels"].items()},
        certs={int(p): bytes.fromhex(c) for p, c in manifest["certs"].items()},
        counters=manifest["counters"], extra_tensors=extra, meta=manifest["meta"],
    )


def _storable(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """CPU, contiguous, and no two tensors overlapping in memory (safetensors refuses shared storage)."""
    out = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    end = 0
    for name in sorted((n for n in out if out[n].nbytes), key=lambda n: out[n].data_ptr()):
        if out[name].data_ptr() < end:
            out[name] = out[name].clone()
        else:
            end = out[name].data_ptr() + out[name].nbytes
    return out


def _step_dirs(root: Path) -> list[Path]:
    """`step-<t>` folders under root, highest t first."""
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def _candidates(root: Path) -> list[Path]:
    """What `load_latest` tries: `step-<t>` and `.replaced-<t>` folders, highest t first, `step-<t>` first."""
    if not root.is_dir():
        return []
    found = [(int(m[1]), rx is _STEP_DIR, p) for p in root.iterdir() for rx in (_STEP_DIR, _REPLACED_DIR)
             if (m := rx.fullmatch(p.name)) and p.is_dir()]
    return [p for *_, p in sorted(found, reverse=True)]


def _step_of(path: Path) -> int:
    m = _STEP_DIR.fullmatch(path.name) or _REPLACED_DIR.fullmatch(path.name)
    return int(m[1]) if m else -1


def _sha256(path: Path, *, fsync: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _manifest_digest(manifest: dict) -> str:
    return hashlib.sha256(_canonical({k: v for k, v in manifest.items() if k != "manifest_sha256"})).hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


def _is_json(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return isinstance(value, _SCALARS)
