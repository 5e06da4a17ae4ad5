"""Membership by certificate and revocation by amendment (coordinator/certs.py, docs/protocol.md §7.18): the
formats and their checks, the roster's decisions, the CLI's one-line errors, and a live allowlist swarm in which
a certified key trains until the creator revokes it, after which every peer refuses it without a restart."""

from __future__ import annotations

import dataclasses
import hashlib
import ssl
import time
import urllib.error
import urllib.request

import pytest
from click.testing import CliRunner

from diloco.coordinator.certs import (
    AMENDMENT_DOMAIN,
    CERT_DOMAIN,
    CLOCK_SKEW_S,
    Amendment,
    AuthRecord,
    Certificate,
    Roster,
)
from diloco.coordinator.runspec import Genesis, RunSpec
from diloco.coordinator.wire import DELTA, ROUTE_DELTA
from diloco.node.cli import main
from diloco.node.reach import REACH, ROUTE_REACH
from diloco.node.swarm import JoinError
from diloco.node.train import new_run
from diloco.protocol import canonical
from diloco.protocol.envelope import seal
from diloco.protocol.errors import BadSignature, Expired, Malformed, WrongRun
from diloco.protocol.identity import Identity, verify

from .swarm_utils import LocalLearner, wait_until

NOW = 1_800_000_000


def test_a_specs_run_id_is_the_hash_of_its_canonical_form_computed_once_per_spec():
    """Every role check asks for the run id (~40 us to encode and hash the spec): it is kept per spec, and a
    changed spec is a new one with its own."""
    spec = RunSpec(name="x", allowlist=(bytes(32),), membership="allowlist")
    assert spec.run_id == hashlib.sha256(spec.encode()).digest()
    assert spec.run_id is spec.run_id
    other = dataclasses.replace(spec, allowlist=(bytes(31) + b"\1",))
    assert other.run_id == hashlib.sha256(other.encode()).digest() != spec.run_id


def allowlist_run(creator: Identity, *listed: Identity, name: str = "certs") -> RunSpec:
    spec = RunSpec(name, membership="allowlist", allowlist=tuple(k.public_key for k in listed))
    return Genesis.create(creator, spec).spec


@pytest.fixture
def run():
    creator, listed, peer = Identity.generate(), Identity.generate(), Identity.generate()
    return creator, listed, peer, allowlist_run(creator, listed)


# -- certificates -----------------------------------------------------------------------------------------


def test_a_certificate_round_trips_and_verifies_inside_its_window_with_the_clock_skew(run, tmp_path):
    creator, _, peer, spec = run
    cert = Certificate.issue(creator, spec, peer.public_key, days=2, now=NOW)
    assert (cert.not_before, cert.not_after) == (NOW, NOW + 2 * 86400)
    assert Certificate.from_bytes(cert.to_bytes()) == cert
    assert Certificate.load(cert.save(tmp_path / "p.cert")) == cert
    assert cert.signed_message() == CERT_DOMAIN + canonical.packb([spec.run_id, peer.public_key, NOW, NOW + 172800])
    for t in (NOW - CLOCK_SKEW_S, NOW, NOW + 172800 + CLOCK_SKEW_S):
        cert.verify(spec, now=t)
    for t in (NOW - CLOCK_SKEW_S - 1, NOW + 172800 + CLOCK_SKEW_S + 1):
        with pytest.raises(Expired):
            cert.verify(spec, now=t)


def test_a_certificate_of_another_run_another_signer_or_changed_fields_is_refused(run):
    creator, listed, peer, spec = run
    cert = Certificate.issue(creator, spec, peer.public_key, days=1, now=NOW)
    with pytest.raises(WrongRun):
        cert.verify(allowlist_run(creator, listed, name="another"), now=NOW)
    forged = dataclasses.replace(cert, signature=listed.sign(cert.signed_message()))  # a member, not the creator
    with pytest.raises(BadSignature):
        forged.verify(spec, now=NOW)
    for changed in (dataclasses.replace(cert, peer=listed.public_key), dataclasses.replace(cert, not_after=NOW + 10**8)):
        with pytest.raises(BadSignature):
            changed.verify(spec, now=NOW)
    # the same fields under the amendment's domain are another message: no signature crosses kinds
    with pytest.raises(BadSignature):
        verify(spec.creator, cert.signature, AMENDMENT_DOMAIN + cert.signed_message()[len(CERT_DOMAIN):])


def test_only_the_creator_of_an_allowlist_run_issues_certificates(run):
    creator, listed, peer, spec = run
    with pytest.raises(ValueError, match="not the run's creator"):
        Certificate.issue(listed, spec, peer.public_key, days=1)
    with pytest.raises(ValueError, match="open"):
        Certificate.issue(creator, Genesis.create(creator, RunSpec("open")).spec, peer.public_key, days=1)
    with pytest.raises(ValueError, match="more than 0 days"):
        Certificate.issue(creator, spec, peer.public_key, days=0)


def test_certificate_decoding_is_strict(run):
    creator, _, peer, spec = run
    wire = Certificate.issue(creator, spec, peer.public_key, days=1, now=NOW).to_wire()
    bad = [{**wire, "extra": 1}, {**wire, "peer": b"x" * 31}, {**wire, "not_after": NOW - 1},
           {**wire, "not_before": True}, {**wire, "signature": b""}, [1, 2]]
    for obj in bad:
        with pytest.raises(Malformed):
            Certificate.from_wire(obj)
    with pytest.raises(Malformed):
        Certificate.from_bytes(b"\xc1")


# -- amendments -------------------------------------------------------------------------------------------


def test_amendments_are_cumulative_and_numbered_and_only_the_creator_signs_them(run):
    creator, listed, peer, spec = run
    first = Amendment.issue(creator, spec, revoke=[listed.public_key])
    assert (first.seq, first.revoke, first.allow) == (1, (listed.public_key,), ())
    second = Amendment.issue(creator, spec, allow=[peer.public_key], previous=first)
    assert (second.seq, second.revoke, second.allow) == (2, (listed.public_key,), (peer.public_key,))
    third = Amendment.issue(creator, spec, allow=[listed.public_key], revoke=[peer.public_key], previous=second)
    assert (third.seq, third.revoke, third.allow) == (3, (peer.public_key,), (listed.public_key,))
    assert Amendment.from_bytes(third.to_bytes()) == third
    third.verify(spec)
    with pytest.raises(BadSignature):
        dataclasses.replace(third, signature=listed.sign(third.signed_message())).verify(spec)
    with pytest.raises(BadSignature):
        dataclasses.replace(third, seq=99).verify(spec)
    with pytest.raises(WrongRun):
        third.verify(allowlist_run(creator, listed, name="another"))
    with pytest.raises(ValueError, match="creator cannot be revoked"):
        Amendment.issue(creator, spec, revoke=[creator.public_key])
    with pytest.raises(ValueError, match="revoked and allowed"):
        Amendment.issue(creator, spec, revoke=[peer.public_key], allow=[peer.public_key])
    with pytest.raises(ValueError, match="not the run's creator"):
        Amendment.issue(listed, spec, revoke=[peer.public_key])


def test_amendment_decoding_refuses_unsorted_duplicate_or_overlapping_lists(run):
    creator, listed, peer, spec = run
    wire = Amendment.issue(creator, spec, revoke=[listed.public_key, peer.public_key]).to_wire()
    for obj in ({**wire, "revoke": wire["revoke"][::-1]}, {**wire, "revoke": [wire["revoke"][0]] * 2},
                {**wire, "allow": wire["revoke"][:1]}, {**wire, "seq": 0}, {**wire, "revoke": [b"k"]}):
        with pytest.raises(Malformed):
            Amendment.from_wire(obj)


# -- the roster -------------------------------------------------------------------------------------------


def test_the_roster_admits_listed_and_certified_keys_and_the_newest_amendment_revokes_them(run):
    creator, listed, peer, spec = run
    clock = [float(NOW)]
    roster = Roster(spec, clock=lambda: clock[0])
    stranger = Identity.generate()
    assert roster.admits(creator.public_key) and roster.admits(listed.public_key)
    assert not roster.admits(peer.public_key) and not roster.admits_peer(peer.peer_id)
    cert = Certificate.issue(creator, spec, peer.public_key, days=1, now=NOW)
    roster.learn(stranger.peer_id, AuthRecord(cert))  # under another peer's subkey: not taken
    assert not roster.admits(peer.public_key)
    roster.learn(peer.peer_id, AuthRecord(cert))
    assert roster.admits(peer.public_key) and roster.admits_peer(peer.peer_id)
    clock[0] = NOW + 86400 + CLOCK_SKEW_S + 1  # expired
    assert not roster.admits(peer.public_key)
    clock[0] = NOW
    first = Amendment.issue(creator, spec, revoke=[listed.public_key, peer.public_key])
    assert roster.adopt(first) and not roster.adopt(first)
    assert not roster.admits(listed.public_key) and not roster.admits(peer.public_key)
    assert roster.admits(creator.public_key)
    second = Amendment.issue(creator, spec, allow=[listed.public_key, stranger.public_key], previous=first)
    roster.learn(stranger.peer_id, AuthRecord(None, second))  # anyone may relay it: the signature decides
    assert roster.admits(listed.public_key) and roster.admits_peer(stranger.peer_id)
    assert not roster.admits(peer.public_key)
    roster.learn(peer.peer_id, AuthRecord(None, first))  # an older one changes nothing
    assert roster.amendment == second
    forged = dataclasses.replace(second, seq=7, revoke=(), allow=(peer.public_key,))
    roster.learn(peer.peer_id, AuthRecord(None, forged))
    assert roster.amendment == second and not roster.admits(peer.public_key)


def test_an_auth_record_round_trips_and_is_decoded_strictly(run):
    creator, _, peer, spec = run
    record = AuthRecord(Certificate.issue(creator, spec, peer.public_key, days=1),
                        Amendment.issue(creator, spec, allow=[peer.public_key]))
    assert AuthRecord.decode(record.encode()) == record
    assert AuthRecord.decode(AuthRecord().encode()) == AuthRecord()
    for junk in (canonical.packb({"certificate": None}), canonical.packb({"certificate": 1, "amendment": None})):
        with pytest.raises(Malformed):
            AuthRecord.decode(junk)


# -- the CLI ----------------------------------------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture
def cli_run(tmp_path):
    """An allowlist run (spec file) by a creator key file, and the key of a peer it does not list."""
    creator, peer = tmp_path / "creator.pem", tmp_path / "peer.pem"
    invoke("keygen", "--out", str(peer))
    other = Identity.generate()
    r = invoke("init-run", "--name", "t", "--key", str(creator), "--out", str(tmp_path / "run.spec"),
               "--allow", other.public_key.hex())
    assert r.exit_code == 0, r.output
    return tmp_path, creator, Identity.load(peer), tmp_path / "run.spec"


def one_line_error(r, text: str) -> None:
    assert r.exit_code != 0 and text in r.output and "Traceback" not in r.output, r.output


def test_certify_writes_a_certificate_that_verifies_for_the_run(cli_run):
    tmp, creator, peer, spec_path = cli_run
    r = invoke("certify", "--run", str(spec_path), "--key", str(creator), "--peer", peer.public_key.hex(),
               "--days", "3", "--out", str(tmp / "p.cert"))
    assert r.exit_code == 0, r.output
    cert = Certificate.load(tmp / "p.cert")
    cert.verify(Genesis.load(spec_path).spec)
    assert cert.peer == peer.public_key and cert.not_after - cert.not_before == 3 * 86400
    assert peer.peer_id in r.output and "--cert" in r.output


def test_certify_and_amend_argument_errors_are_one_line(cli_run, tmp_path):
    tmp, creator, peer, spec_path = cli_run
    spec = ["--run", str(spec_path)]
    one_line_error(invoke("certify", *spec, "--key", str(creator), "--peer", "abc", "--days", "1"),
                   "not a public key")
    one_line_error(invoke("certify", *spec, "--key", str(tmp / "peer.pem"), "--peer", peer.public_key.hex(),
                          "--days", "1"), "not this run's creator")
    one_line_error(invoke("certify", *spec, "--key", str(tmp / "missing.pem"), "--peer", peer.public_key.hex(),
                          "--days", "1"), "missing.pem")
    one_line_error(invoke("certify", *spec, "--key", str(creator), "--peer", peer.public_key.hex(),
                          "--days", "0"), "--days")
    one_line_error(invoke("certify", *spec, "--key", str(creator), "--peer", peer.public_key.hex(),
                          "--days", "1e300"), "2^63")
    invoke("init-run", "--name", "o", "--key", str(creator), "--out", str(tmp / "open.spec"))
    one_line_error(invoke("certify", "--run", str(tmp / "open.spec"), "--key", str(creator), "--peer",
                          peer.public_key.hex(), "--days", "1"), "open")
    one_line_error(invoke("amend", *spec, "--key", str(creator)), "nothing to amend")
    one_line_error(invoke("amend", *spec, "--key", str(creator), "--revoke", "zz"), "not a public key")
    creator_key = Identity.load(creator).public_key.hex()
    one_line_error(invoke("amend", *spec, "--key", str(creator), "--revoke", creator_key), "cannot be revoked")
    one_line_error(invoke("amend", *spec, "--key", str(creator), "--revoke", peer.public_key.hex(), "--allow",
                          peer.public_key.hex()), "revoked and allowed")
    (tmp / "junk.amend").write_bytes(b"\x00junk")
    one_line_error(invoke("amend", *spec, "--key", str(creator), "--revoke", peer.public_key.hex(), "--out",
                          str(tmp / "junk.amend")), "previous amendment")


def test_amend_numbers_each_amendment_above_the_previous_file(cli_run):
    _, creator, peer, spec_path = cli_run
    other = Identity.generate()
    for args, seq in ((("--revoke", peer.public_key.hex()), 1), (("--allow", other.public_key.hex()), 2)):
        r = invoke("amend", "--run", str(spec_path), "--key", str(creator), *args)
        assert r.exit_code == 0 and f"seq {seq}" in r.output, r.output
    a = Amendment.load(spec_path.with_name("run.spec.amend"))
    a.verify(Genesis.load(spec_path).spec)
    assert (a.seq, a.revoke, a.allow) == (2, (peer.public_key,), (other.public_key,))


def test_join_with_a_certificate_that_is_not_valid_for_this_key_run_or_time_is_one_line(cli_run):
    tmp, creator, peer, spec_path = cli_run
    spec = Genesis.load(spec_path).spec
    creator_id = Identity.load(creator)
    join = ["join", "--run", str(spec_path), "--listen", "127.0.0.1:0", "--steps", "1", "--key", str(tmp / "peer.pem")]
    Certificate.issue(creator_id, spec, Identity.generate().public_key, days=1).save(tmp / "other.cert")
    one_line_error(invoke(*join, "--cert", str(tmp / "other.cert")), "for another key")
    Certificate.issue(creator_id, spec, peer.public_key, days=1, now=time.time() - 3 * 86400).save(tmp / "old.cert")
    one_line_error(invoke(*join, "--cert", str(tmp / "old.cert")), "valid from")
    invoke("init-run", "--name", "t2", "--key", str(creator), "--out", str(tmp / "two.spec"), "--allow",
           peer.public_key.hex())
    two = Genesis.load(tmp / "two.spec").spec
    Certificate.issue(creator_id, two, peer.public_key, days=1).save(tmp / "two.cert")
    one_line_error(invoke(*join, "--cert", str(tmp / "two.cert")), "for run")
    one_line_error(invoke(*join, "--cert", str(tmp / "missing.cert")), "cannot read certificate")


# -- live: a certified learner trains, is revoked, and is refused everywhere without a restart ----------


def post(url: str, route: str, frame: bytes) -> int:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # (the peers' TLS is bound to keys, not names)
    req = urllib.request.Request(url + route, data=frame, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_certified_key_trains_until_the_creator_revokes_it_then_every_peer_refuses_it(tmp_path):
    """Creator, listed and certified learners of one private run; `diloco-node amend --revoke --peers` posts the
    amendment to the listed learner only: the others read it from the DHT."""
    creator, listed, certified = Identity.generate(), Identity.generate(), Identity.generate()
    genesis = new_run(creator, "certs-live", task="markov", inner_steps=10, fragments=4, quorum=2, codec="int8",
                      membership="allowlist", allowlist=(listed.public_key,))
    spec = genesis.spec
    cert = Certificate.issue(creator, spec, certified.public_key, days=1)
    nodes = []
    try:
        a = LocalLearner(genesis, 0, learner_kw={"identity": creator}).start()
        nodes.append(a)
        nodes.append(LocalLearner(genesis, 1, [a.url], learner_kw={"identity": listed}).start())
        d = LocalLearner(genesis, 2, [a.url], learner_kw={"identity": certified}, certificate=cert).start()
        nodes.append(d)
        others = nodes[:2]
        wait_until(lambda: all(len(n.learner.swarm.members.live()) == 3 for n in nodes), 30, "3 live members")
        for _ in range(4):
            for n in nodes:
                n.train(10)
        wait_until(lambda: d.learner.swarm.store.merged_steps > 0, 60, "the certified learner's steps merged")
        assert d.learner.swarm.sync.stats["deltas_sent"] > 0

        def frames() -> list[bytes]:  # fresh envelopes of the certified key (a nonce each)
            return [seal(certified, DELTA, spec.run_id, {}, b"").to_bytes(),
                    seal(certified, REACH, spec.run_id, {"url": d.url}, b"").to_bytes()]

        before = [post(n.url, route, f) for n in others for route, f in zip((ROUTE_DELTA, ROUTE_REACH), frames(), strict=True)]
        assert 403 not in before, before
        creator.save(tmp_path / "creator.pem")
        genesis.save(tmp_path / "run.spec")
        t0 = time.monotonic()
        r = invoke("amend", "--run", str(tmp_path / "run.spec"), "--key", str(tmp_path / "creator.pem"),
                   "--revoke", certified.public_key.hex(), "--peers", nodes[1].url)
        assert r.exit_code == 0 and "the swarm holds amendment 1" in r.output, r.output
        amendment = Amendment.load(tmp_path / "run.spec.amend")
        wait_until(lambda: all(post(n.url, route, f) == 403 for n in others
                               for route, f in zip((ROUTE_DELTA, ROUTE_REACH), frames(), strict=True)), 15,
                   "403 for the revoked key at every peer")
        took = time.monotonic() - t0
        cid = certified.peer_id
        wait_until(lambda: all(cid not in n.learner.swarm.members.live_learners() for n in others), 10,
                   "the revoked key's member record ignored")
        assert all(cid not in n.learner.swarm.members.roles(p) for n in others for p in range(spec.fragments))
        assert all(n.learner.swarm.roster.amendment == amendment for n in others)
        assert took < 10, took
        # a restart with the revoked key is refused at the join, in one line
        again = LocalLearner(genesis, 3, [a.url], learner_kw={"identity": certified}, certificate=cert,
                             join_timeout_s=10)
        with pytest.raises(JoinError, match="refused this peer's certificate"):
            again.start()
        again.learner.close()
    finally:
        for n in nodes:
            n.learner.close()
