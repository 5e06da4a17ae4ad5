"""Local checkpoints (docs/architecture.md §5.6): whole and verified, or never loaded."""

import ast
import json
import logging
import pickle
import shutil
import stat
from pathlib import Path

import pytest
import torch

from diloco.node import checkpoint as ckpt_mod
from diloco.node.checkpoint import (
    Checkpoint,
    CheckpointCorrupt,
    capture,
    load_checkpoint,
    load_latest,
    restore,
    save_checkpoint,
)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


def _train(model, optimizer, steps: int, start: int = 0) -> None:
    for t in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 + t)
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _full(step: int = 3) -> Checkpoint:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    _train(model, opt, 2)
    return capture(
        model, opt, step=step,
        anchors={0: torch.randn(40), 1: torch.randn(18)},
        labels={0: (2, 7), 1: (3, 1)},
        certs={0: b"\x00cert-0\xff", 1: b""},
        counters={"t": step, "c_steps": {"0": 1, "1": 2}, "c_tokens": {"0": 512, "1": 1024}},
        extra_tensors={"shard/0/momentum": torch.randn(40), "ids": torch.arange(5), "half": torch.ones(3).bfloat16()},
        meta={"run_id": "ab" * 16, "peer_id": "peer-1", "wall_time": 1712345678.25},
    )


def _assert_same(a: Checkpoint, b: Checkpoint) -> None:
    assert a.step == b.step
    for x, y in [(a.params, b.params), (a.anchors, b.anchors), (a.extra_tensors, b.extra_tensors)]:
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
    assert a.optimizer["state"].keys() == b.optimizer["state"].keys()
    for i, s in a.optimizer["state"].items():
        assert s.keys() == b.optimizer["state"][i].keys()
        for k, v in s.items():
            w = b.optimizer["state"][i][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
    assert len(a.optimizer["param_groups"]) == len(b.optimizer["param_groups"])
    for g, h in zip(a.optimizer["param_groups"], b.optimizer["param_groups"], strict=True):
        assert g.keys() == h.keys()
        assert all(list(v) == list(h[k]) if isinstance(v, tuple | list) else v == h[k] for k, v in g.items())
    assert (a.labels, a.certs, a.counters, a.meta) == (b.labels, b.certs, b.counters, b.meta)


def _steps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_round_trip_preserves_params_optimizer_anchors_labels_certs_counters_extra_and_meta(tmp_path):
    original = _full()
    path = save_checkpoint(tmp_path, original)
    assert path == tmp_path / "step-3"
    _assert_same(original, load_checkpoint(path))
    _assert_same(original, load_latest(tmp_path))


def test_tensors_are_namespaced_and_manifest_records_digest_shape_and_dtype(tmp_path):
    path = save_checkpoint(tmp_path, _full())
    manifest = json.loads((path / "manifest.json").read_text())
    names = set(manifest["tensors"])
    assert {"param/0.weight", "optim/0/exp_avg", "optim/0/step", "anchor/1", "extra/shard/0/momentum"} <= names
    assert manifest["tensors"]["extra/half"] == {"shape": [3], "dtype": "bfloat16"}
    assert manifest["format_version"] == 1 and len(manifest["tensors_sha256"]) == 64
    assert manifest["labels"]["0"] == [2, 7] and manifest["certs"]["0"] == b"\x00cert-0\xff".hex()


def test_a_crash_mid_write_never_yields_a_loadable_bad_checkpoint(tmp_path, caplog):
    save_checkpoint(tmp_path, _full(step=1))
    # a crashed write: a complete-looking temp folder, and a step folder whose files never reached the disk
    shutil.copytree(tmp_path / "step-1", tmp_path / ".tmp-crashed")
    half = tmp_path / "step-7"
    half.mkdir()
    (half / "tensors.safetensors").write_bytes((tmp_path / "step-1" / "tensors.safetensors").read_bytes()[:100])
    (half / "manifest.json").write_text('{"format": "diloco-checkp')
    with caplog.at_level(logging.WARNING):
        loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 1
    assert "step-7" in caplog.text and ".tmp-crashed" not in caplog.text
    with pytest.raises(CheckpointCorrupt, match="manifest unreadable"):
        load_checkpoint(half)
    save_checkpoint(tmp_path, _full(step=2))
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_a_failed_write_leaves_no_step_folder_and_no_temp_folder(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, _full())
    assert _steps(tmp_path) == []


def test_truncated_tensors_file_is_detected_by_digest_and_the_older_one_is_loaded(tmp_path, caplog):
    save_checkpoint(tmp_path, _full(step=1))
    newest = save_checkpoint(tmp_path, _full(step=2))
    data = (newest / "tensors.safetensors").read_bytes()
    (newest / "tensors.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointCorrupt, match="digest"):
        load_checkpoint(newest)
    with caplog.at_level(logging.WARNING):
        assert load_latest(tmp_path).step == 1
    assert "step-2" in caplog.text and "digest" in caplog.text


@pytest.mark.parametrize("where", ["header", "data", "last"])
def test_a_flipped_byte_in_the_tensors_file_is_detected(tmp_path, where):
    path = save_checkpoint(tmp_path, _full())
    data = bytearray((path / "tensors.safetensors").read_bytes())
    data[{"header": 20, "data": len(data) // 2, "last": -1}[where]] ^= 0x01
    (path / "tensors.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="tensors file digest mismatch"):
        load_checkpoint(path)
    assert load_latest(tmp_path) is None


def _edit_label(m):
    m["labels"]["0"] = [9, 9]


def _edit_shape(m):
    m["tensors"]["anchor/0"]["shape"] = [20, 2]


def _edit_digest(m):
    m["tensors_sha256"] = "0" * 64


def _edit_drop_counters(m):
    del m["counters"]


def _edit_version(m):
    m["format_version"] = 2


@pytest.mark.parametrize("edit", [_edit_label, _edit_shape, _edit_digest, _edit_drop_counters, _edit_version])
def test_an_edited_manifest_is_refused(tmp_path, edit):
    path = save_checkpoint(tmp_path, _full())
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorrupt):
        load_checkpoint(path)
    assert load_latest(tmp_path) is None


def test_a_renamed_step_folder_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, _full(step=3))
    path.rename(tmp_path / "step-9")
    with pytest.raises(CheckpointCorrupt, match="folder says step 9"):
        load_checkpoint(tmp_path / "step-9")


def test_keep_prunes_all_but_the_newest_checkpoints(tmp_path):
    small = Checkpoint(step=0, params={"w": torch.ones(2)}, optimizer={"state": {}, "param_groups": []})
    for step in range(5):
        small.step = step
        save_checkpoint(tmp_path, small)
    assert _steps(tmp_path) == ["step-3", "step-4"]
    small.step = 5
    save_checkpoint(tmp_path, small, keep=1)
    assert _steps(tmp_path) == ["step-5"]
    assert load_latest(tmp_path).step == 5


def test_saving_the_same_step_again_replaces_it(tmp_path):
    a = Checkpoint(step=4, params={"w": torch.zeros(2)}, optimizer={"state": {}, "param_groups": []})
    save_checkpoint(tmp_path, a)
    a.params["w"] = torch.ones(2)
    save_checkpoint(tmp_path, a)
    assert _steps(tmp_path) == ["step-4"]
    assert torch.equal(load_latest(tmp_path).params["w"], torch.ones(2))


def test_no_valid_checkpoint_means_none(tmp_path):
    assert load_latest(tmp_path / "missing") is None
    assert load_latest(tmp_path) is None
    (tmp_path / "step-1").mkdir()
    assert load_latest(tmp_path) is None


def test_module_never_pickles(tmp_path, monkeypatch):
    tree = ast.parse(Path(ckpt_mod.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not {"pickle", "dill", "cloudpickle"} & (imported | names)
    assert not {"load", "save"} & attributes
    assert {n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ("dumps", "loads")
            and isinstance(n.value, ast.Name)} == {"json"}

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle used")

    for target, attr in [(torch, "load"), (torch, "save"), (pickle, "dumps"), (pickle, "loads"), (pickle, "dump"),
                         (pickle, "load"), (pickle, "Unpickler"), (pickle, "Pickler")]:
        monkeypatch.setattr(target, attr, forbidden)
    original = _full()
    _assert_same(original, load_checkpoint(save_checkpoint(tmp_path, original)))


def test_tensors_file_is_plain_safetensors_and_manifest_plain_json(tmp_path):
    path = save_checkpoint(tmp_path, _full())
    data = (path / "tensors.safetensors").read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    assert "anchor/0" in header and header["anchor/0"]["dtype"] == "F32"
    json.loads((path / "manifest.json").read_text())


def test_adamw_continues_bit_identically_after_restore(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    _train(model, opt, 3)
    save_checkpoint(tmp_path, capture(model, opt, step=3))
    _train(model, opt, 3, start=3)

    other = _model(seed=1)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5, betas=(0.5, 0.5))
    restore(load_latest(tmp_path), other, other_opt)
    assert other_opt.param_groups[0]["betas"] == (0.8, 0.95) and other_opt.param_groups[0]["lr"] == 1e-2
    _train(other, other_opt, 3, start=3)
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)


def test_sgd_momentum_continues_bit_identically_after_restore(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    _train(model, opt, 3)
    save_checkpoint(tmp_path, capture(model, opt, step=3))
    _train(model, opt, 2, start=3)

    other = _model(seed=1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    restore(load_latest(tmp_path), other, other_opt)
    _train(other, other_opt, 2, start=3)
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)


def test_restore_copies_in_place_and_never_aliases_the_checkpoint(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    save_checkpoint(tmp_path, capture(model, opt, step=2))
    loaded = load_latest(tmp_path)
    before = {k: v.clone() for k, v in loaded.optimizer["state"][0].items()}
    pointers = [p.data_ptr() for p in model.parameters()]
    restore(loaded, model, opt)
    assert [p.data_ptr() for p in model.parameters()] == pointers
    _train(model, opt, 2, start=2)
    assert all(torch.equal(v, loaded.optimizer["state"][0][k]) for k, v in before.items())


def test_restore_refuses_a_checkpoint_that_does_not_fit_and_changes_nothing():
    model = _model()
    snapshot = capture(model, None, step=0)
    snapshot.params["0.weight"] = torch.zeros(3, 3)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="0.weight"):
        restore(snapshot, model, None)
    del snapshot.params["0.weight"]
    with pytest.raises(KeyError, match="missing"):
        restore(snapshot, model, None)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_optimizer_state_that_is_neither_tensor_nor_json_scalar_is_a_type_error(tmp_path):
    bad = Checkpoint(step=1, params={}, optimizer={"state": {0: {"history": [1.0, 2.0]}}, "param_groups": []})
    with pytest.raises(TypeError, match="history"):
        save_checkpoint(tmp_path, bad)
    bad.optimizer = {"state": {}, "param_groups": [{"schedule": object(), "params": [0]}]}
    with pytest.raises(TypeError, match="schedule"):
        save_checkpoint(tmp_path, bad)
    assert _steps(tmp_path) == []


def test_scalar_state_and_tensor_hyperparameters_round_trip(tmp_path):
    optimizer = {
        "state": {0: {"step": 5, "flag": True, "buf": None, "m": torch.ones(2)}, 1: {}},
        "param_groups": [{"lr": torch.tensor(0.01), "betas": (0.9, 0.99), "params": [0, 1]}],
    }
    path = save_checkpoint(tmp_path, Checkpoint(step=1, params={}, optimizer=optimizer))
    loaded = load_checkpoint(path).optimizer
    assert loaded["state"][0]["step"] == 5 and loaded["state"][0]["flag"] is True and loaded["state"][1] == {}
    assert loaded["state"][0]["buf"] is None and torch.equal(loaded["state"][0]["m"], torch.ones(2))
    assert torch.equal(loaded["param_groups"][0]["lr"], torch.tensor(0.01))
    assert loaded["param_groups"][0]["betas"] == [0.9, 0.99]


def test_tensors_sharing_memory_are_saved(tmp_path):
    flat = torch.arange(10.0)
    shared = Checkpoint(step=1, params={"a": flat, "tied": flat}, optimizer={"state": {}, "param_groups": []},
                        anchors={0: flat[:5], 1: flat[5:]})
    loaded = load_checkpoint(save_checkpoint(tmp_path, shared))
    assert torch.equal(loaded.params["tied"], flat) and torch.equal(loaded.anchors[1], flat[5:])


def test_checkpoint_files_are_private_to_their_owner(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt", _full())
    for p in [tmp_path / "ckpt", path, *path.iterdir()]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode & 0o077 == 0, (p, oct(mode))
        assert mode & 0o600 == 0o600


def test_saved_momenta_come_back_exactly_and_one_that_does_not_fit_the_run_is_left_out(tmp_path, caplog):
    from diloco.coordinator.fragments import Encoded
    from diloco.coordinator.version import Version
    from diloco.node import saved_momenta
    from diloco.protocol.codecs import get_codec

    def enc(name: str, t: torch.Tensor) -> Encoded:
        codec = get_codec(name)
        return Encoded(codec, *codec.encode(t))

    good_fp32, good_int8 = torch.randn(300), torch.randn(300)
    nan = torch.randn(300)
    nan[7] = float("nan")
    held = {0: (Version(65537, 4), enc("fp32", good_fp32)), 1: (Version(3, 9), enc("int8", good_int8)),
            2: (Version(3, 9), Encoded(get_codec("fp32"), {"codec": "fp32", "shape": [300]},
                                       nan.numpy().tobytes())),
            3: (Version(3, 9), enc("int8", torch.randn(299))), 4: (Version(1, 1), enc("fp16", torch.randn(300)))}
    ck = Checkpoint(step=5, params={}, optimizer={"state": {}, "param_groups": []})
    saved_momenta.add_to(ck, held)
    save_checkpoint(tmp_path, ck)
    loaded = load_checkpoint(tmp_path / "step-5")
    with caplog.at_level(logging.WARNING, logger="diloco.node.saved_momenta"):
        back = saved_momenta.read_from(loaded, "int8", [300] * 5)
    assert set(back) == {0, 1}
    assert back[0][0] == Version(65537, 4) and torch.equal(back[0][1].decode(300), good_fp32)
    assert back[1][0] == Version(3, 9)
    assert torch.equal(back[1][1].decode(300), held[1][1].decode(300))  # the int8 bytes as they were kept
    left_out = {r.getMessage().split(":")[0] for r in caplog.records}
    assert left_out == {f"checkpoint momentum of fragment {p} left out" for p in (2, 3, 4)}
    # a checkpoint of another run shape (fewer fragments) keeps only what fits
    assert set(saved_momenta.read_from(loaded, "int8", [300])) == {0}
