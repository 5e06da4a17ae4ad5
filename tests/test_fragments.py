import dataclasses

import blake3
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.coordinator.fragments import KEEP_UPDATES, FragmentStore
from diloco.coordinator.version import GENESIS, Version
from diloco.coordinator.wire import anchor_digest
from diloco.protocol.errors import StaleVersion

from .helpers import feed

V1, V2 = Version(0, 1), Version(0, 2)


def NO_COPY(p, anchor):  # noqa: N802 - these tests read what is replaced from `Changes.replace`
    pass


def store(n=6):
    return FragmentStore([torch.zeros(n), torch.ones(n), torch.ones(n)], self_id="me")


def test_a_new_version_moves_theta_by_the_update():
    s = store()
    u = torch.full((6,), 0.5)
    s.advance(0, GENESIS, V1, u, b"f", b"c", contributors=["other"])
    changes = s.take_changes(NO_COPY)
    assert len(changes.moves[0]) == 1 and torch.equal(changes.moves[0][0], u)
    assert changes.labels[0] == V1 and not changes.replace
    assert torch.equal(s.held[0].anchor, u)


def test_a_version_that_merged_our_delta_also_takes_that_progress_out_of_theta():
    s = store()
    sent = torch.full((6,), -0.25)  # Δ = Θ − θ: we had moved θ by +0.25
    assert s.set_outstanding(0, GENESIS, sent, steps=10)
    u = torch.full((6,), 0.2)
    s.advance(0, GENESIS, V1, u, b"f", b"c", contributors=["me", "other"])
    assert torch.allclose(sum(s.take_changes(NO_COPY).moves[0]), u + sent)
    assert s.merged_steps == 10 and 0 not in s.rebase.outstanding


def test_our_delta_stays_outstanding_until_a_version_merges_it():
    s = store()
    s.set_outstanding(0, GENESIS, torch.ones(6), steps=3)
    s.advance(0, GENESIS, V1, torch.zeros(6), b"f", b"c", contributors=["other"])
    assert 0 in s.rebase.outstanding and s.merged_steps == 0


def test_moves_of_several_versions_add_up_between_two_steps():
    s = store()
    s.advance(1, GENESIS, V1, torch.ones(6), b"f", b"c")
    s.advance(1, V1, V2, torch.ones(6), b"g", b"d")
    assert torch.equal(sum(s.take_changes(NO_COPY).moves[1]), torch.full((6,), 2.0))
    assert s.take_changes(NO_COPY).moves == {}


def test_a_whole_download_replaces_theta_and_forgets_the_outstanding_delta():
    s = store()
    s.set_outstanding(0, GENESIS, torch.ones(6), 5)
    s.advance(0, GENESIS, V1, torch.ones(6), b"f", b"c")
    s.install(0, torch.full((6,), 7.0), Version(1, 9), b"cert")
    changes = s.take_changes(NO_COPY)
    assert 0 not in changes.moves and changes.replace == {0} and torch.equal(s.held[0].anchor, torch.full((6,), 7.0))
    assert 0 not in s.rebase.outstanding


def test_outstanding_delta_refused_when_the_anchor_moved_since_the_snapshot():
    s = store()
    s.advance(0, GENESIS, V1, torch.ones(6), b"f", b"c")
    assert s.set_outstanding(0, GENESIS, torch.ones(6), 1) is None


def test_versions_never_regress():
    s = store()
    s.advance(0, GENESIS, V2, torch.ones(6), b"f", b"c")
    with pytest.raises(StaleVersion):
        s.advance(0, GENESIS, V1, torch.ones(6), b"f", b"c")
    with pytest.raises(StaleVersion):
        s.install(0, torch.zeros(6), V1, b"c")
    assert s.label(0) == V2


def test_a_result_checked_outside_the_lock_is_refused_if_the_anchor_was_written_meanwhile():
    s = store()
    anchor, label, generation = s.read(0)
    result = anchor + torch.ones(6)  # what a holder computes and hashes without the lock
    s.install(0, torch.full((6,), 5.0), V1, b"c")  # a download lands meanwhile
    with pytest.raises(StaleVersion):
        s.advance(0, V1, V2, torch.ones(6), b"f", b"c", result=result, generation=generation)
    assert s.label(0) == V1 and torch.equal(s.held[0].anchor, torch.full((6,), 5.0))
    anchor, _, generation = s.read(0)
    s.advance(0, V1, V2, torch.ones(6), b"f", b"c", result=anchor + torch.ones(6), generation=generation)
    assert s.label(0) == V2 and torch.equal(s.held[0].anchor, torch.full((6,), 6.0))


def test_a_repair_replaces_an_anchor_of_the_same_label_only_if_it_was_not_written_since():
    s = store()
    s.advance(0, GENESIS, V1, torch.ones(6), b"f", b"c")
    _, _, generation = s.read(0)
    with pytest.raises(StaleVersion):
        s.install(0, torch.full((6,), 2.0), V1, b"c")  # same label, no repair: refused
    s.install(0, torch.full((6,), 2.0), V1, b"c", repair_of=generation)
    assert torch.equal(s.held[0].anchor, torch.full((6,), 2.0))
    with pytest.raises(StaleVersion):
        s.install(0, torch.full((6,), 3.0), V1, b"c", repair_of=generation)  # checked before the last write


def test_kept_updates_lead_from_an_old_version_to_the_current_one_within_a_byte_per_parameter():
    s = store()  # (6 elements: the kept frames may take 6 bytes together)
    s.advance(0, GENESIS, V1, torch.ones(6), b"f1", b"c")
    s.advance(0, V1, V2, torch.ones(6), b"f2", b"c")
    assert s.updates_after(0, V1) == [b"f2"]
    assert s.updates_after(0, GENESIS) == [b"f1", b"f2"], "two small frames fit"
    assert s.updates_after(0, Version(5, 5)) is None
    s.advance(0, V2, Version(1, 3), torch.ones(6), b"f3-", b"c")
    assert s.updates_after(0, GENESIS) is None, "the oldest frame went: 7 bytes do not fit"
    assert s.updates_after(0, V1) == [b"f2", b"f3-"]
    s.advance(0, Version(1, 3), Version(1, 4), torch.ones(6), b"a large frame", b"c")
    assert s.updates_after(0, Version(1, 3)) == [b"a large frame"], "the newest one is kept whatever its size"
    assert s.updates_after(0, V2) is None
    at = Version(1, 4)
    for v in range(5, 5 + KEEP_UPDATES + 2):  # tiny frames: at most KEEP_UPDATES of them
        s.advance(0, at, Version(1, v), torch.ones(6), b"", b"c")
        at = Version(1, v)
    assert len(s.updates_after(0, Version(1, 4 + 2))) == KEEP_UPDATES
    assert s.updates_after(0, Version(1, 4 + 1)) is None


def test_steps_of_a_delta_never_merged_are_counted_by_the_next_one_that_is():
    s = store()
    assert s.set_outstanding(0, GENESIS, torch.ones(6), 5, 50) == (5, 50)
    s.drop_outstanding(0)  # refused: its progress is still in θ, the next delta carries it
    s.carry(0, 2, 20)  # never sent (the anchor moved)
    assert s.set_outstanding(0, GENESIS, torch.ones(6), 3, 30) == (10, 100)
    assert s.set_outstanding(0, GENESIS, torch.ones(6), 1, 10) == (11, 110)  # superseded before a merge
    s.advance(0, GENESIS, V1, torch.zeros(6), b"f", b"c", contributors=["me"])
    assert (s.merged_steps, s.merged_tokens) == (11, 110)


def test_an_install_forgets_carried_steps_because_it_overwrites_that_progress():
    s = store()
    s.carry(0, 4, 40)
    s.install(0, torch.zeros(6), V1, b"cert")
    assert s.set_outstanding(0, V1, torch.ones(6), 1, 10) == (1, 10)


def test_a_fragment_in_flight_settles_when_merged_refused_or_overwritten():
    s = store()
    s.record_versions()
    for p in (0, 1, 2):
        s.begin_send(p)
        s.set_outstanding(p, GENESIS, torch.ones(6), 1)
        s.end_send(p, accepted=p != 1)  # fragment 1 was refused
    assert not s.wait_settled([0], timeout=0.01) and s.wait_settled([1], timeout=0.01)
    s.advance(0, GENESIS, V1, torch.zeros(6), b"f", b"c", contributors=["me"])
    s.install(2, torch.zeros(6), V2, b"cert")
    assert s.wait_settled(range(3), timeout=0.01)
    assert s.take_accepted() == [(0, V1.term, V1.version), (2, V2.term, V2.version)] and s.take_accepted() == []


def _fragment_body(cert: bytes, values: torch.Tensor) -> bytes:
    from diloco.coordinator.wire import pack_fragment

    head, data = pack_fragment(cert, values.numpy().data.cast("B"))
    return bytes(head) + bytes(data)


@pytest.mark.parametrize("piece", [1, 3, 5, 7, 4096])
def test_a_fragment_download_read_in_pieces_of_any_size_lands_in_one_tensor(piece):
    from diloco.coordinator.wire import FragmentReader

    values = torch.arange(300, dtype=torch.float32)
    body = _fragment_body(b"c" * 37, values)
    reader = FragmentReader(300)
    feed(reader, body, [piece] * (len(body) // piece))
    assert reader.cert == b"c" * 37 and torch.equal(reader.anchor, values)
    assert anchor_digest(reader.anchor) == anchor_digest(values)


def test_a_fragment_download_of_the_wrong_size_or_shape_is_refused():
    from diloco.coordinator.wire import FragmentReader
    from diloco.protocol.errors import Malformed

    body = _fragment_body(b"cert", torch.ones(10))
    reader = FragmentReader(10)
    with pytest.raises(Malformed):
        reader.begin(len(body) + 70_001)  # more than any certificate explains
    with pytest.raises(Malformed):
        feed(reader, body + b"\0\0\0\0")  # one element too many: the certificate's length does not fit
    with pytest.raises(Malformed):
        feed(reader, _fragment_body(b"cert", torch.ones(9)))  # one element short
    with pytest.raises(Malformed):
        feed(reader, b"\xff\xff\xff\xff" + bytes(40))  # a certificate length no certificate has
    reader.begin(len(body))
    for part in (body[:4], body[4:6]):  # the certificate's length, then half the certificate
        reader.buffer()[: len(part)] = part
        reader.advance(len(part))
    with pytest.raises(Malformed):
        reader.end()  # ended inside the certificate
    feed(reader, body)  # and the same reader still takes a whole download (a retry begins again)
    assert reader.cert == b"cert" and torch.equal(reader.anchor, torch.ones(10))


def test_an_unset_fragment_takes_no_update_until_filled_or_installed():
    store = FragmentStore([torch.empty(4), torch.empty(4)], unset=[0, 1])
    with pytest.raises(StaleVersion):
        store.advance(0, GENESIS, Version(1, 1), torch.ones(4), b"f", b"c")
    assert store.fill(0, torch.full((4,), 2.0)) and not store.fill(0, torch.zeros(4))
    store.advance(0, GENESIS, Version(1, 1), torch.ones(4), b"f", b"c")
    assert torch.equal(store.held[0].anchor, torch.full((4,), 3.0))
    fresh = torch.full((4,), 7.0)
    store.install(1, fresh, Version(1, 5), b"c", adopt=True)
    assert store.held[1].anchor is fresh and not store.unset


def test_an_unset_fragment_is_downloaded_into_its_own_anchor_once_at_a_time():
    store = FragmentStore([torch.empty(4), torch.zeros(4)], unset=[0])
    target = store.begin_download(0)
    assert target is store.held[0].anchor
    assert store.begin_download(0) is None, "a second download of it goes to a tensor of its own"
    assert store.begin_download(1) is None, "a fragment with values is never written in place"
    assert not store.fill(0, torch.zeros(4)), "never filled under a download"
    target.copy_(torch.arange(4.0))
    store.install(0, target, Version(2, 3), b"cert", adopt=True)
    store.end_download(0)
    assert store.held[0].anchor is target and torch.equal(target, torch.arange(4.0)) and not store.unset
    assert store.label(0) == Version(2, 3) and not store.downloading


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 16), st.lists(st.integers(1, 64), max_size=12),
       st.booleans())
def test_any_bytes_in_any_pieces_either_read_as_the_fragment_sent_or_are_refused(junk, numel, cuts, honest):
    from diloco.coordinator.wire import FragmentReader
    from diloco.protocol.errors import Malformed

    values = torch.arange(numel, dtype=torch.float32)
    body = _fragment_body(junk[:40], values) if honest else junk
    reader = FragmentReader(numel)
    try:
        feed(reader, body, cuts)
    except Malformed:
        assert not honest
        return
    assert reader.anchor.numel() == numel and len(reader.cert) + 4 + 4 * numel == len(body)
    if honest:
        assert reader.cert == junk[:40] and torch.equal(reader.anchor, values)


def test_the_anchor_digest_is_blake3_of_the_fp32_bytes_as_the_protocol_example():
    values = torch.tensor([1.0, -0.5, 0.0])  # docs/protocol.md §7.3
    assert values.numpy().tobytes() == bytes.fromhex("0000803f000000bf00000000")
    assert anchor_digest(values) == bytes.fromhex("8a024c7114f6aa8cc7dc9a1a8d3e93b43c9936b45e009127b1ad08a5f48c7580")
    assert anchor_digest(values) == blake3.blake3(values.numpy().tobytes()).digest()
    assert anchor_digest(torch.arange(6.0).view(2, 3).t()) == anchor_digest(torch.tensor([0.0, 3, 1, 4, 2, 5]))


def test_member_record_encodes_as_the_protocol_example_and_refuses_a_wrong_shape():
    from diloco.coordinator.wire import MemberRecord
    from diloco.protocol import canonical
    from diloco.protocol.errors import Malformed

    record = MemberRecord("http://127.0.0.1:7000", "local", False, 120, 0.05, 20480.0, True)
    example = (  # docs/protocol.md §7.4
        "88 ab636c69656e745f6d6f6465 c2 a46c656674 c2 a6726567696f6e a56c6f63616c a473746570 78 "
        "ab737465705f74696d655f73 cb3fa999999999999a a673796e636564 c3 ac746f6b656e735f7065725f73 "
        "cb40d4000000000000 a375726c b5687474703a2f2f3132372e302e302e313a37303030")
    assert record.encode() == bytes.fromhex(example.replace(" ", ""))
    gone = dataclasses.replace(record, left=True)
    assert MemberRecord.decode(gone.encode()) == gone
    fields = dict(record.__dict__)
    for broken in ({**fields, "left": 1}, {k: v for k, v in fields.items() if k != "left"}):
        with pytest.raises(Malformed):
            MemberRecord.decode(canonical.packb(broken))
