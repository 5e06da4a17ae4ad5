"""Signed DHT records and their storage: the subkey rule, signatures, sizes, expirations, last writer wins."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.protocol import canonical
from diloco.protocol.dht import DHTStorage, ForgedSubkey, NodeInfo, StoredValue, ValueRecord
from diloco.protocol.errors import (
    BackPressure,
    BadSignature,
    Expired,
    Malformed,
    ProtocolError,
    StaleVersion,
    TooLarge,
)
from diloco.protocol.identity import Identity

ALICE, BOB = Identity.generate(), Identity.generate()
NOW = 1_700_000_000.0
KEY = "run:abc:members"


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def storage(**kw) -> tuple[DHTStorage, Clock]:
    clock = Clock()
    return DHTStorage(clock=clock, **kw), clock


def rec(
    who: Identity = ALICE, key: str = KEY, value: bytes = b"v", ttl: float = 30.0, subkey: str | None = None
):
    return ValueRecord.create(who, key, value, NOW + ttl, subkey=subkey)


def wire_round_trip(obj):
    return canonical.unpackb(canonical.packb(obj))


# -- NodeInfo -----------------------------------------------------------------------------------------------


def test_node_info_round_trips_through_canonical_msgpack():
    info = NodeInfo.create(ALICE, "http://10.0.0.1:7000", "eu-west", now_ms=123)
    back = NodeInfo.from_wire(wire_round_trip(info.to_wire()))
    assert back == info and back.node_id == ALICE.node_id and back.peer_id == ALICE.peer_id
    client = NodeInfo.create(BOB, "", "home", client_mode=True)
    assert NodeInfo.from_wire(client.to_wire()).client_mode is True


@pytest.mark.parametrize(
    "field,value",
    [
        ("url", "http://10.0.0.2:7000"),
        ("region", "us"),
        ("client_mode", True),
        ("timestamp_ms", 124),
        ("public_key", BOB.public_key),
    ],
)
def test_node_info_with_any_tampered_field_is_refused(field, value):
    wire = NodeInfo.create(ALICE, "http://10.0.0.1:7000", "eu-west", now_ms=123).to_wire()
    with pytest.raises(BadSignature):
        NodeInfo.from_wire({**wire, field: value})


@pytest.mark.parametrize(
    "url",
    [
        "",
        "ftp://h:1",
        "http://",
        "http://h:99999",
        "http://h:1/?q=1",
        "http://u@h:1",
        "http://h:1#f",
        "http://h :1",
        "http://" + "h" * 300,
    ],
)
def test_node_info_url_of_a_listening_node_must_be_http_host_port(url):
    with pytest.raises(Malformed):
        NodeInfo.create(ALICE, url, "eu")


def test_node_info_with_extra_or_missing_fields_is_malformed():
    wire = NodeInfo.create(ALICE, "http://h:1", "eu").to_wire()
    with pytest.raises(Malformed):
        NodeInfo.from_wire({**wire, "extra": 1})
    with pytest.raises(Malformed):
        NodeInfo.from_wire({k: v for k, v in wire.items() if k != "region"})


# -- ValueRecord ---------------------------------------------------------------------------------------------


def test_value_record_round_trips_and_verifies():
    for r in (rec(), rec(subkey=ALICE.peer_id)):
        back = ValueRecord.from_wire(wire_round_trip(r.to_wire()))
        assert back == r
        back.verify()


@pytest.mark.parametrize(
    "field,value",
    [("key", "run:abc:other"), ("value", b"w"), ("expiration", NOW + 31.0), ("signer", BOB.public_key)],
)
def test_value_record_with_any_tampered_field_is_refused(field, value):
    with pytest.raises(BadSignature):
        ValueRecord.from_wire({**rec().to_wire(), field: value})


def test_a_signature_for_one_subkey_does_not_verify_as_plain():
    with pytest.raises(BadSignature):
        ValueRecord.from_wire({**rec(subkey=ALICE.peer_id).to_wire(), "subkey": None})


def test_forged_subkey_is_refused_at_creation_and_on_the_wire():
    with pytest.raises(ForgedSubkey):
        ValueRecord.create(ALICE, KEY, b"v", NOW + 30, subkey=BOB.peer_id)
    # Alice signs correctly over Bob's subkey by hand: still refused, as a ForgedSubkey (a BadSignature).
    forged = dataclasses.replace(rec(), subkey=BOB.peer_id)
    forged = dataclasses.replace(forged, signature=ALICE.sign(forged.signed_message()))
    with pytest.raises(ForgedSubkey) as err:
        ValueRecord.from_wire(forged.to_wire())
    assert isinstance(err.value, BadSignature) and err.value.status == 401 and BOB.peer_id in err.value.reason


node_info_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=300),
    st.binary(max_size=70),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(
    obj=st.one_of(node_info_values, st.dictionaries(st.text(max_size=12), node_info_values, max_size=8)),
    field=st.sampled_from(
        [
            "public_key",
            "url",
            "region",
            "client_mode",
            "timestamp_ms",
            "signature",
            "key",
            "subkey",
            "value",
            "expiration",
            "signer",
        ]
    ),
    junk=node_info_values,
)
def test_from_wire_of_arbitrary_input_only_raises_protocol_errors(obj, field, junk):
    node = NodeInfo.create(ALICE, "http://h:1", "eu", now_ms=1).to_wire()
    value = rec(subkey=ALICE.peer_id).to_wire()
    for decode in (NodeInfo.from_wire, ValueRecord.from_wire):
        for candidate in (obj, {**node, field: junk}, {**value, field: junk}):
            try:
                decode(candidate)
            except ProtocolError:
                pass


# -- DHTStorage ----------------------------------------------------------------------------------------------


def test_forged_subkey_record_is_refused_and_stored_nowhere():
    store, _ = storage()
    forged = dataclasses.replace(rec(), subkey=BOB.peer_id)
    forged = dataclasses.replace(forged, signature=ALICE.sign(forged.signed_message()))
    with pytest.raises(ForgedSubkey):
        store.store(forged)
    assert len(store) == 0 and store.get(KEY) is None


def test_bad_signature_is_refused_and_stored_nowhere():
    store, _ = storage()
    bad = dataclasses.replace(rec(), value=b"changed")
    with pytest.raises(BadSignature):
        store.store(bad)
    assert len(store) == 0 and store.get(KEY) is None and store.items_for_republish() == []


def test_oversized_value_is_refused():
    store, _ = storage(max_value_bytes=10)
    store.store(rec(value=b"x" * 10))
    with pytest.raises(TooLarge):
        store.store(rec(key="other", value=b"x" * 11))
    assert store.get("other") is None and len(store) == 1


def test_expired_and_too_far_future_records_are_refused():
    store, _ = storage(max_expiration_s=3600, max_clock_skew_s=60)
    for ttl in (-1.0, 0.0, 3600 + 61):
        with pytest.raises(Expired):
            store.store(rec(ttl=ttl))
    store.store(rec(ttl=3600 + 59))
    assert len(store) == 1


def test_newer_expiration_replaces_older_and_older_is_refused():
    store, _ = storage()
    store.store(rec(value=b"old", ttl=10))
    store.store(rec(who=BOB, value=b"new", ttl=20))  # plain keys: anyone may write, last writer wins
    assert store.get(KEY).plain.value == b"new"
    with pytest.raises(StaleVersion) as err:
        store.store(rec(value=b"older", ttl=15))
    assert err.value.status == 409 and store.get(KEY).plain.value == b"new"
    store.store(rec(who=BOB, value=b"new", ttl=20))  # the same record again (a republish) is a no-op
    assert len(store) == 1 and store.total_bytes == 3


def test_equal_expiration_keeps_the_same_winner_in_either_order():
    a, b = rec(value=b"a"), rec(who=BOB, value=b"b")
    winners = []
    for first, second in ((a, b), (b, a)):
        store, _ = storage()
        store.store(first)
        try:
            store.store(second)
        except StaleVersion:
            pass
        winners.append(store.get(KEY).plain)
    assert winners[0] == winners[1]


def test_subkeys_form_a_dictionary_beside_the_plain_value():
    store, _ = storage()
    store.store(rec(ALICE, value=b"a", subkey=ALICE.peer_id))
    store.store(rec(BOB, value=b"b", subkey=BOB.peer_id))
    store.store(rec(BOB, value=b"plain"))
    got = store.get(KEY)
    assert isinstance(got, StoredValue) and got.plain.value == b"plain"
    assert {s: r.value for s, r in got.subkeys.items()} == {ALICE.peer_id: b"a", BOB.peer_id: b"b"}
    store.store(rec(ALICE, value=b"a2", ttl=40, subkey=ALICE.peer_id))
    assert store.get_record(KEY, ALICE.peer_id).value == b"a2" and len(store) == 3


def test_expired_records_are_never_returned_and_are_purged():
    store, clock = storage()
    store.store(rec(ALICE, ttl=10, subkey=ALICE.peer_id))
    store.store(rec(BOB, ttl=20, subkey=BOB.peer_id))
    store.store(rec(key="plain", ttl=10))
    clock.t = NOW + 10
    assert list(store.get(KEY).subkeys) == [BOB.peer_id]
    assert store.get("plain") is None and store.get_record(KEY, ALICE.peer_id) is None
    assert [r.subkey for r in store.items_for_republish()] == [BOB.peer_id]
    clock.t = NOW + 20
    assert store.purge() == 1 and len(store) == 0 and store.total_bytes == 0


def test_full_storage_refuses_new_records_with_back_pressure_but_accepts_updates():
    store, clock = storage(max_keys=2)
    store.store(rec(key="a", ttl=10))
    store.store(rec(key="b", ttl=30))
    with pytest.raises(BackPressure):
        store.store(rec(key="c"))
    assert store.get("c") is None
    store.store(rec(key="b", ttl=40))  # an update of a held key needs no room
    clock.t = NOW + 10  # "a" expires: room is made by purging
    store.store(rec(key="c", ttl=50))
    assert store.get("c") is not None and len(store) == 2


def test_total_value_bytes_are_bounded():
    store, _ = storage(max_total_bytes=10)
    store.store(rec(key="a", value=b"x" * 6))
    with pytest.raises(BackPressure):
        store.store(rec(key="b", value=b"x" * 5))
    assert store.total_bytes == 6 and store.get("b") is None


@settings(max_examples=200, deadline=None)
@given(pos=st.integers(0, 10_000), flip=st.integers(1, 255), which=st.booleans())
def test_any_single_byte_corruption_of_a_signed_record_is_refused(pos, flip, which):
    obj = rec(subkey=ALICE.peer_id) if which else NodeInfo.create(ALICE, "http://h:1", "eu", now_ms=1)
    data = bytearray(canonical.packb(obj.to_wire()))
    data[pos % len(data)] ^= flip
    with pytest.raises(ProtocolError):
        type(obj).from_wire(canonical.unpackb(bytes(data)))
