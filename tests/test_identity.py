import os
import stat

import pytest
from click.testing import CliRunner

from diloco.node.cli import main
from diloco.protocol.errors import BadSignature, Malformed
from diloco.protocol.identity import Identity, KeyFileError, b58encode, node_id_of, peer_id_of, verify


def test_peer_id_is_base58_of_sha256_of_raw_public_key(identity):
    import hashlib

    digest = hashlib.sha256(identity.public_key).digest()
    assert identity.peer_id == b58encode(digest)
    assert identity.node_id == int.from_bytes(digest[:20], "big") == node_id_of(identity.public_key)


def test_base58_known_vectors():
    assert b58encode(b"") == ""
    assert b58encode(b"\0\0\x01") == "112"
    assert b58encode(b"hello world") == "StV1DL6CwTryKyV"


def test_key_file_is_written_0600_and_loads_back(tmp_path, identity):
    path = identity.save(tmp_path / "k.pem")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Identity.load(path).public_key == identity.public_key


def test_key_file_readable_by_others_is_refused_with_chmod_hint(tmp_path, identity):
    path = identity.save(tmp_path / "k.pem")
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match=r"chmod 600 .*k\.pem"):
        Identity.load(path)


def test_existing_key_file_is_not_overwritten_without_force(tmp_path, identity):
    identity.save(tmp_path / "k.pem")
    with pytest.raises(KeyFileError, match="--force"):
        Identity.generate().save(tmp_path / "k.pem")


def test_garbage_key_file_is_a_key_file_error(tmp_path):
    p = tmp_path / "k.pem"
    p.write_bytes(b"not a key")
    p.chmod(0o600)
    with pytest.raises(KeyFileError, match="not an unencrypted PEM"):
        Identity.load(p)


def test_missing_key_file_says_how_to_create_one(tmp_path):
    with pytest.raises(KeyFileError, match="keygen"):
        Identity.load(tmp_path / "nope.pem")


def test_signature_verifies_and_tampering_fails(identity):
    sig = identity.sign(b"msg")
    verify(identity.public_key, sig, b"msg")
    with pytest.raises(BadSignature):
        verify(identity.public_key, sig, b"msh")
    with pytest.raises(BadSignature):
        verify(Identity.generate().public_key, sig, b"msg")
    with pytest.raises(Malformed):
        verify(identity.public_key[:31], sig, b"msg")


def test_cli_keygen_writes_key_and_prints_peer_id(tmp_path):
    out = tmp_path / "key.pem"
    r = CliRunner().invoke(main, ["keygen", "--out", str(out)])
    assert r.exit_code == 0, r.output
    peer = r.output.split("peer_id: ")[1].split()[0]
    assert peer == Identity.load(out).peer_id
    assert peer == peer_id_of(Identity.load(out).public_key)


def test_cli_keygen_refuses_to_overwrite_in_one_line(tmp_path):
    out = tmp_path / "key.pem"
    CliRunner().invoke(main, ["keygen", "--out", str(out)])
    r = CliRunner().invoke(main, ["keygen", "--out", str(out)])
    assert r.exit_code == 1
    assert "Traceback" not in r.output and "already exists" in r.output


def test_cli_version_and_help():
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and "diloco-node" in r.output
    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0 and "keygen" in r.output
