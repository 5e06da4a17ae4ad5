"""RunSpec: everything the swarm must agree on, and the run id that names it (docs/architecture.md §2).

The canonical msgpack of the spec is hashed into the run id; the run's creator signs it (the genesis record),
so a joiner holding the file and the creator's public key knows it trains the run everybody else trains.
Peers with a different run id refuse each other (409). The fragment plan's digest is part of the spec, so two
peers with different model code cannot join the same run by accident.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco.protocol import canonical
from diloco.protocol.codecs import Codec, available_codecs, get_codec
from diloco.protocol.errors import Malformed
from diloco.protocol.identity import PUBLIC_KEY_BYTES, Identity, peer_id_of, verify

GENESIS_DOMAIN = b"diloco-node/v1/genesis\0"
MEMBERSHIP_POLICIES = ("open", "allowlist")


@dataclass(frozen=True)
class RunSpec:
    """The run's shared settings. Defaults are the figures quoted in the README."""

    name: str
    task: str = "markov"
    model: dict[str, Any] = field(default_factory=dict)  # task model overrides (GPTConfig fields or preset)
    seed: int = 0  # initial parameters Θ^(0) come from this seed on every peer
    fragments: int = 4  # P
    inner_steps: int = 100  # H
    quorum: int = 2  # K
    grace_gamma: float = 1.0  # γ
    overlap: float = 10.0  # τ, in inner steps
    grace_cap_s: float = 30.0
    outer_lr: float = 0.2  # not the paper's 0.7: the global model's sweep at M = 4 and 8 (docs/architecture.md §6.3)
    outer_momentum: float = 0.9
    codec: str = "int8"
    error_feedback: bool = False
    max_staleness: int = 4
    max_tokens_per_step: int = 1 << 24  # a delta claiming more tokens than steps × this is refused
    max_share: float = 0.5  # no learner's share of a merge above this (at least 1/M): docs/architecture.md §6.2
    replicas: int = 1
    synchronous: bool = False  # the synchronous baseline (docs/architecture.md §10): quorum is every learner,
    # no grace window, learners block until their previous delta of a fragment is merged and checkpoint at a barrier
    membership: str = "open"
    allowlist: tuple[bytes, ...] = ()  # raw Ed25519 public keys, for membership "allowlist"
    plan_digest: bytes = b""
    genesis_digest: bytes = b""  # SHA-256 over every fragment's Θ^(0) anchor digest (learner.genesis_digest)
    creator: bytes = b""  # the creator's raw public key
    created_ms: int = 0

    def __post_init__(self) -> None:
        problems = []
        if not self.name or len(self.name) > 128:
            problems.append("name must be 1-128 characters")
        if self.fragments < 1:
            problems.append("fragments must be >= 1")
        if self.inner_steps < 1:
            problems.append("inner_steps must be >= 1")
        if self.quorum < 1:
            problems.append("quorum must be >= 1")
        if self.synchronous and (self.grace_gamma != 0 or self.grace_cap_s != 0):
            problems.append("a synchronous run has no grace window: set grace_gamma and grace_cap_s to 0")
        if self.max_staleness < 0 or self.replicas < 0:
            problems.append("max_staleness and replicas must be >= 0")
        if self.max_tokens_per_step < 1 or not 0 < self.max_share <= 1:
            problems.append("max_tokens_per_step must be >= 1 and max_share in (0, 1]")
        if not 0 <= self.outer_momentum < 1 or not self.outer_lr > 0:
            problems.append("outer_lr must be > 0 and outer_momentum in [0, 1)")
        problems += codec_problems(self)
        if self.membership not in MEMBERSHIP_POLICIES:
            problems.append(f"membership must be one of {MEMBERSHIP_POLICIES}")
        if any(len(k) != PUBLIC_KEY_BYTES for k in self.allowlist):
            problems.append("allowlist entries must be 32-byte public keys")
        if problems:
            raise Malformed("invalid run spec: " + "; ".join(problems))

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["allowlist"] = list(self.allowlist)
        return d

    @classmethod
    def from_wire(cls, obj: Any) -> RunSpec:
        if not isinstance(obj, dict):
            raise Malformed("run spec must be a map")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(obj) - names
        if unknown:
            raise Malformed(f"run spec has unknown fields {sorted(unknown)} (written by a newer version?)")
        kw = dict(obj)
        if "allowlist" in kw:
            if not isinstance(kw["allowlist"], list):
                raise Malformed("allowlist must be a list")
            kw["allowlist"] = tuple(kw["allowlist"])
        try:
            spec = cls(**kw)
        except TypeError as e:
            raise Malformed(f"invalid run spec: {e}") from None
        for f in dataclasses.fields(cls):
            v = getattr(spec, f.name)
            want = {"int": int, "float": (int, float), "str": str, "bool": bool, "bytes": bytes}.get(str(f.type))
            if want is not None and (not isinstance(v, want) or (want is int and isinstance(v, bool))):
                raise Malformed(f"run spec field {f.name} must be {f.type}")
        # (the two fields of no simple type: a task reads `model` as a map, `is_member` compares keys as bytes)
        if not isinstance(spec.model, dict) or not all(isinstance(k, bytes) for k in spec.allowlist):
            raise Malformed("run spec field model must be a map and allowlist a list of 32-byte keys")
        return spec

    def encode(self) -> bytes:
        return canonical.packb(self.to_wire())

    @functools.cached_property
    def run_id(self) -> bytes:
        """SHA-256 of the canonical spec (once per spec: ~40 us, and the loop asks for it at every role check)."""
        return hashlib.sha256(self.encode()).digest()

    def is_member(self, public_key: bytes) -> bool:
        return self.membership == "open" or public_key in self.allowlist or public_key == self.creator


# The defaults of a run whose codec is sparse (`topk`), where the run's fields leave them unset: no outer
# momentum (its update is the sparse merge itself; a momentum would spread it over every coordinate), lr 1.0
# (each coordinate's merge is already its senders' mean), and H = 60: a sparse delta carries a few percent of
# the progress, so it goes out more often than int8's (H = 50 to 100 swept: README, Sparse; docs/protocol.md §7.21).
SPARSE_DEFAULTS = {"outer_lr": 1.0, "outer_momentum": 0.0, "inner_steps": 60}


def codec_defaults(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` (RunSpec's) with those of `SPARSE_DEFAULTS` left unset (absent, or None as a CLI passes them)
    filled in: `SPARSE_DEFAULTS` for a sparse codec, the RunSpec defaults otherwise."""
    given = {k: v for k, v in fields.items() if not (k in SPARSE_DEFAULTS and v is None)}
    codec = known_codec(given.get("codec"))
    return {**SPARSE_DEFAULTS, **given} if codec is not None and codec.sparse else given


def known_codec(name: Any) -> Codec | None:
    """The codec `name` names (a registered one, or a variant such as `topk:4096:32:2`), or None. A
    `hivemind_*` name is None here: its adapter is imported only when a peer first needs it."""
    if not isinstance(name, str) or name.startswith("hivemind_"):
        return None
    try:
        return get_codec(name)
    except Malformed:
        return None


def codec_problems(spec: RunSpec) -> list[str]:
    """What is wrong with the spec's codec: a name no peer could decode (a `hivemind_*` adapter is registered
    when first asked for, so any such name passes here)."""
    name, codec = spec.codec, known_codec(spec.codec)
    if codec is None and not (isinstance(name, str) and name.startswith("hivemind_")):
        return [f"codec must be one of {', '.join(available_codecs())} (or topk:CHUNK:K:BITS), got "
                f"{str(name)[:40]!r}"]
    if codec is not None and codec.sparse and spec.outer_momentum != 0:
        # its update is the sparse merge itself; a momentum would make it dense (docs/protocol.md §7.21)
        return [f"codec {name} needs outer_momentum 0 (its learners' error feedback takes momentum's place)"]
    return []


@dataclass(frozen=True)
class Genesis:
    """A RunSpec signed by its creator: the file `diloco-node init-run` writes and `join --run` reads."""

    spec: RunSpec
    signature: bytes

    @classmethod
    def create(cls, creator: Identity, spec: RunSpec) -> Genesis:
        spec = dataclasses.replace(spec, creator=creator.public_key)
        return cls(spec, creator.sign(GENESIS_DOMAIN + spec.encode()))

    def verify(self, expected_creator: bytes | None = None) -> None:
        if expected_creator is not None and self.spec.creator != expected_creator:
            raise Malformed(f"run spec was created by {peer_id_of(self.spec.creator)}, not the expected creator")
        verify(self.spec.creator, self.signature, GENESIS_DOMAIN + self.spec.encode())

    def to_bytes(self) -> bytes:
        return canonical.packb({"spec": self.spec.to_wire(), "signature": self.signature})

    @classmethod
    def from_bytes(cls, data: bytes) -> Genesis:
        obj = canonical.unpackb(data, max_len=1 << 20)
        if not isinstance(obj, dict) or set(obj) != {"spec", "signature"} or not isinstance(obj["signature"], bytes):
            raise Malformed("genesis file must hold {spec, signature}")
        g = cls(RunSpec.from_wire(obj["spec"]), obj["signature"])
        g.verify()
        return g

    def save(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(self.to_bytes())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Genesis:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise Malformed(f"cannot read run spec {path}: {e.strerror}") from None
        return cls.from_bytes(data)
