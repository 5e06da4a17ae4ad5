"""The fuzzer's engine: seeded mutators of bytes and of decoded values, a tally, and a hypothesis driver.

Why mutate valid inputs: a decoder refuses random bytes at its first check, so the fuzzer starts from real
sealed envelopes, encoded tensors and DHT messages and breaks them a little, which reaches the later checks.
hypothesis draws one seed per input (reproducible with `hypothesis.seed`); a `random.Random` of that seed
drives the mutations, which keeps each input cheap to make.
"""

from __future__ import annotations

import math
import random
import signal
import struct
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st

from diloco.protocol.errors import ProtocolError

INTERESTING_INTS = [0, 1, -1, 2, 7, 8, 127, 128, 255, 256, 511, 512, 513, 1023, 65535, 65536, 65537,
                    2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63),
                    -(2**31), -128]
INTERESTING_FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-300, 1e300, math.inf, -math.inf, math.nan, 3.4e38, 5e-324]
INTERESTING_BYTES = [0x00, 0x01, 0x7F, 0x80, 0xFF, 0x90, 0x9F, 0xC0, 0xC1, 0xC2, 0xC3, 0xC4, 0xCA, 0xCB,
                     0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD9, 0xDC, 0xDD, 0xDE, 0xDF, 0xE0, 0xC7, 0xD4, 0xD6, 0xD8]


class Hang(BaseException):
    """An input that ran past its time bound (raised by SIGALRM; a BaseException so no handler eats it)."""


# -- bytes ------------------------------------------------------------------------------------------------


def mutate_bytes(rng: random.Random, data: bytes, pool: list[bytes] | None = None) -> bytes:
    """One to four random edits of `data`: bit flips, interesting bytes or u32s, inserts, deletes, splices."""
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 4))):
        op = rng.randrange(10)
        n = len(b)
        if op == 0 and n:
            i = rng.randrange(n)
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            b[rng.randrange(n)] = rng.choice(INTERESTING_BYTES)
        elif op == 2 and n >= 4:
            i = rng.randrange(n - 3)
            b[i : i + 4] = struct.pack(">I", rng.choice(INTERESTING_INTS) & 0xFFFFFFFF)
        elif op == 3:
            i = rng.randrange(n + 1)
            b[i:i] = rng.randbytes(rng.choice((1, 2, 4, 16, 100)))
        elif op == 4 and n:
            i = rng.randrange(n)
            del b[i : i + rng.choice((1, 2, 4, 32, n))]
        elif op == 5 and n:
            b = b[: rng.randrange(n)]
        elif op == 6 and n:
            i, j = sorted((rng.randrange(n), rng.randrange(n)))
            b[j:j] = b[i : i + min(j - i, 64)]
        elif op == 7 and pool:
            other = rng.choice(pool)
            cut, cut2 = rng.randrange(len(b) + 1), rng.randrange(len(other) + 1)
            b = b[:cut] + other[cut2:]
        elif op == 8 and n:
            if rng.random() < 0.1:  # a long run of digits: numbers beyond what `int(text)` reads
                i = rng.randrange(n + 1)
                b[i:i] = b"9" * rng.choice((20, 4301, 5000))
            else:
                b[rng.randrange(n)] = rng.randrange(256)
        else:
            b += rng.randbytes(rng.choice((1, 3, 8)))
    return bytes(b)


# -- decoded values ----------------------------------------------------------------------------------------


def junk_value(rng: random.Random, depth: int = 0) -> Any:
    """A random value of any msgpack type (including ones a decoder may not expect: floats, deep lists)."""
    r = rng.randrange(14 if depth < 3 else 10)
    if r == 0:
        return None
    if r == 1:
        return rng.random() < 0.5
    if r == 2:
        return rng.choice(INTERESTING_INTS)
    if r == 3:
        return rng.randrange(-1000, 1000)
    if r == 4:
        return rng.choice(INTERESTING_FLOATS)
    if r == 5:
        return rng.choice(["", "x", "fp32", "int8", "int4", "bf16", "fp16", "hivemind_x", "ping", "store",
                           "\x00", "é", "٣", "²", "a" * 300, "1.2", "http://127.0.0.1:1", "\n"])
    if r == 6:
        return rng.randbytes(rng.choice((0, 1, 16, 20, 31, 32, 33, 64)))
    if r == 7:
        return [rng.choice(INTERESTING_INTS), rng.choice(INTERESTING_INTS)]
    if r == 8:
        return []
    if r == 9:
        return {}
    if r == 10:
        return [junk_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if r == 11:
        return {rng.choice(["a", "codec", "shape", "block", "p", "key", ""]): junk_value(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    if r == 12:
        deep: Any = 0
        for _ in range(rng.choice((31, 32, 33, 40))):
            deep = [deep]
        return deep
    return [rng.randrange(0, 70) for _ in range(rng.randrange(1, 5))]


def mutate_value(rng: random.Random, obj: Any, *, keep_root: bool = False) -> Any:
    """`obj` with one to three random changes at random places: a node replaced, a map key removed or added,
    a list shortened or lengthened, an int nudged. `keep_root`: a map stays a map (as when the caller has
    already checked that much, e.g. an envelope's `fields`)."""
    for _ in range(rng.choice((1, 1, 2, 3))):
        obj = _mutate_once(rng, obj, keep_root)
    return obj


def _mutate_once(rng: random.Random, obj: Any, keep: bool = False) -> Any:
    if isinstance(obj, dict) and keep and not obj:
        return {rng.choice(["a", "url", "p"]): junk_value(rng)}
    if isinstance(obj, dict) and obj and (keep or rng.random() < 0.75):
        out = dict(obj)
        k = rng.choice(sorted(out))
        r = rng.randrange(5)
        if r == 0:
            del out[k]
        elif r == 1:
            out[rng.choice(["extra", "zz", k + "_"])] = junk_value(rng)
        else:
            out[k] = _mutate_once(rng, out[k])
        return out
    if isinstance(obj, list) and obj and rng.random() < 0.75:
        out_l = list(obj)
        i = rng.randrange(len(out_l))
        r = rng.randrange(5)
        if r == 0:
            del out_l[i]
        elif r == 1:
            out_l.insert(i, junk_value(rng))
        elif r == 2:
            out_l.append(out_l[i])
        else:
            out_l[i] = _mutate_once(rng, out_l[i])
        return out_l
    if type(obj) is int and rng.random() < 0.5:
        return obj + rng.choice((-1, 1, -obj - 1, 2**32, obj))
    if type(obj) is bytes and obj and rng.random() < 0.5:
        return mutate_bytes(rng, obj)
    if type(obj) is str and rng.random() < 0.3:
        return obj + rng.choice(("x", "\x00", " ", "/", "é"))
    return junk_value(rng)


# -- tally and driver ---------------------------------------------------------------------------------------


@dataclass
class Tally:
    """What the fuzzer saw, per decoder; `failures` keeps the first few untyped errors with their traceback."""

    per_decoder: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    untyped_errors: int = 0
    hangs: int = 0
    state_changes: int = 0
    failures: list[str] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)  # route answers by status, for the report

    def fail(self, decoder: str, what: str, detail: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(f"[{decoder}] {what}: {detail}")

    @property
    def inputs(self) -> int:
        return sum(self.per_decoder.values())


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def check_one(tally: Tally, name: str, call: Callable[[], Any], typed: tuple[type[BaseException], ...],
              bound_s: float, describe: Callable[[], str], state: Callable[[], Any] | None = None) -> bool:
    """Run one input: `call` must return (accepted) or raise one of `typed`, within `bound_s`, and a refused
    input must leave `state()` as it was. Returns whether it was accepted."""
    tally.per_decoder[name] = tally.per_decoder.get(name, 0) + 1
    before = state() if state is not None else None
    accepted = False
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, bound_s)
    try:
        call()
        accepted = True
    except Hang:
        tally.hangs += 1
        tally.fail(name, "hang", describe())
    except typed:
        pass
    except Exception as e:
        tally.untyped_errors += 1
        tally.fail(name, f"untyped {type(e).__name__}: {e}"[:300], describe() + "\n" + traceback.format_exc(limit=6))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if accepted:
        tally.accepted[name] = tally.accepted.get(name, 0) + 1
    elif state is not None and state() != before:
        tally.state_changes += 1
        tally.fail(name, "state changed by a refused input", describe())
    return accepted


PROTOCOL_ERRORS: tuple[type[BaseException], ...] = (ProtocolError,)


def drive(n: int, seed: int, one: Callable[[random.Random], None]) -> None:
    """Call `one(rng)` for `n` hypothesis-drawn seeds, reproducibly (`seed` fixes hypothesis' own)."""

    @hyp_seed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate], derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(st.integers(min_value=0, max_value=2**64 - 1))
    def run(case: int) -> None:
        one(random.Random(case))

    run()
