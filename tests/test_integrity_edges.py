"""Numbers from paths and queries, the catch-up cap, and a delivery that fails: nothing is misread or lost."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from diloco.coordinator.version import Version
from diloco.coordinator.wire import UPDATE, UpdateFields, updates_body_max
from diloco.protocol import canonical
from diloco.protocol.codecs import ErrorFeedback, get_codec
from diloco.protocol.envelope import seal
from diloco.protocol.errors import Malformed
from diloco.protocol.identity import Identity
from diloco.protocol.transport import DEFAULT_MAX_RESPONSE

from .swarm_utils import LocalLearner, tiny_run, wait_until


@pytest.mark.parametrize("text", ["", "²", "٣", "１", "+1", "-1", " 1", "1 ", "0x1", "1" * 20, "9" * 5000])
def test_a_number_in_a_path_or_query_is_ascii_digits_only_and_bounded(text):
    with pytest.raises(Malformed):
        canonical.parse_decimal(text, "a test number")


@given(st.integers(min_value=0, max_value=10**19 - 1))
def test_every_short_ascii_decimal_reads_as_itself(n):
    assert canonical.parse_decimal(str(n), "n") == n


@pytest.mark.parametrize("text", ["1", "1.", ".1", "1.2.3", "١.٠", "1.²", "a.b", "1." + "9" * 30])
def test_a_version_in_a_query_is_two_ascii_decimals(text):
    with pytest.raises(Malformed):
        Version.parse(text)
    assert Version.parse("3.14") == Version(3, 14)


def test_the_catch_up_cap_holds_a_kept_update_of_any_fragment_size():
    int8 = get_codec("int8")
    numel = 10_000
    meta, payload = int8.encode(torch.randn(numel))
    fields = UpdateFields(0, Version(1, 1), Version(1, 2), b"d" * 32, meta, tuple("p" * 43 for _ in range(64)))
    frame = seal(Identity.generate(), UPDATE, b"r" * 32, fields.to_fields(), payload).to_bytes()
    assert len(canonical.packb([frame])) <= updates_body_max(int8.encoded_size(numel), 1)
    # a 100M-parameter fragment's int8 update is ~100 MB: above the default answer cap, within its own
    assert updates_body_max(int8.encoded_size(100_000_000), 1) > max(100_000_000, DEFAULT_MAX_RESPONSE)


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_the_catch_up_cap_holds_every_chain_of_frames_a_holder_keeps(codec):
    from diloco.coordinator.fragments import KEEP_UPDATES, FragmentStore

    c, numel, signer = get_codec(codec), 20_000, Identity.generate()
    store = FragmentStore([torch.zeros(numel)])
    at, first = Version(1, 0), []
    for v in range(1, 25):
        update = torch.randn(numel)  # (as an owner encodes a merge of 4 deltas)
        meta, payload = c.encode_update(update, 4) if hasattr(c, "encode_update") else c.encode(update)
        fields = UpdateFields(0, at, Version(1, v), b"d" * 32, meta, tuple("p" * 43 for _ in range(4)))
        frame = seal(signer, UPDATE, b"r" * 32, fields.to_fields(), payload).to_bytes()
        store.advance(0, store.label(0), Version(1, v), torch.zeros(numel), frame, b"c")
        at = Version(1, v)
        first.append(store.held[0].updates[0][0])
    kept = store.updates_after(0, first[-1])
    assert kept and len(kept) <= KEEP_UPDATES
    assert len(canonical.packb(kept)) <= updates_body_max(c.encoded_size(numel), KEEP_UPDATES, budget=numel)
    assert len(kept) > 1 if codec == "topk" else len(kept) == 1, "sparse updates: several fit in a byte per parameter"


def test_error_feedback_restored_after_an_encode_that_was_never_delivered():
    feedback = ErrorFeedback("int4")
    feedback.encode("0", torch.randn(256))
    before = feedback.residual("0").clone()
    kept = feedback.residual("0")
    feedback.encode("0", torch.randn(256))  # sent, and its delivery failed
    assert not torch.equal(feedback.residual("0"), before)
    feedback.restore("0", kept)
    assert torch.equal(feedback.residual("0"), before), "what earlier encodes carried is still owed"


@pytest.fixture
def alone():
    started: list[LocalLearner] = []

    def make(**fields) -> LocalLearner:
        ll = LocalLearner(tiny_run(**fields), 0).start()
        started.append(ll)
        return ll

    yield make
    for ll in started:
        ll.learner.close()


def _status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.timeout(60)
def test_routes_answer_400_to_a_number_that_is_not_ascii_digits(alone):
    url = alone().url
    for path in ["/v1/fragment/%C2%B2", "/v1/fragment/%D9%A3", "/v1/fragment/" + "1" * 5000, "/v1/fragment/9",
                 "/v1/fragment/0?held=%D9%A1.0", "/v1/fragment/0?held=1",
                 "/v1/updates/%D9%A3?after=0.0", "/v1/updates/0?after=%D9%A1.%D9%A0", "/v1/updates/0?after=1",
                 "/v1/momentum/%C2%B2?label=0.0", "/v1/momentum/0?label=%D9%A1.0", "/v1/momentum/0"]:
        assert _status_of(url + path) == 400, path
    assert _status_of(url + "/v1/momentum/0?label=0.0") == 404  # well formed: nothing held of that version


@pytest.mark.timeout(60)
def test_a_delta_whose_delivery_fails_leaves_the_error_feedback_residual_it_found(alone):
    ll = alone(codec="int4", error_feedback=True)
    sync = ll.learner.swarm.sync
    ll.train(10)  # every fragment's delta sent once (to ourselves: the only owner): residuals exist
    wait_until(lambda: sync.stats["deltas_sent"] >= 4, 10, "the first deltas delivered")
    kept = sync.deltas.feedback.residual("0")
    assert kept is not None

    async def owner_gone(*args) -> bool:
        return False

    sync.deltas._deliver = owner_gone  # the next delivery fails (owner unreachable, every retry spent)
    snapshot = ll.learner.swarm.pool.take(sync.store.numel(0))
    snapshot.copy_(sync.store.held[0].anchor).add_(0.01)
    base = sync.store.label(0)
    fut = asyncio.run_coroutine_threadsafe(sync.deltas.send(0, snapshot, base, 5, 50), ll.learner.swarm._loop)
    assert fut.result(10) is False
    assert sync.deltas.feedback.residual("0") is kept, "a failed delivery dropped what earlier deltas still owe"
