"""Storage survives kill -9 at any instant and a full disk (issue 15, docs/architecture.md §5.6).

Checkpoints: written to a temporary folder, fsynced, renamed; a checkpoint killed at any point of a save leaves
the newest complete one loadable; digests refuse a damaged one and the previous good one is loaded, with the
journal segments since it still there. A full disk fails the save (reported), never the last good checkpoint,
and a torn journal append does not hide the records after it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.coordinator.version import Version
from diloco.node import checkpoint as ckpt_mod
from diloco.node import journal as journal_mod
from diloco.node.checkpoint import (
    Checkpoint,
    CheckpointCorrupt,
    load_checkpoint,
    load_latest,
    save_checkpoint,
)
from diloco.node.journal import Journal, records, replay, segments
from diloco.protocol.identity import Identity

from .swarm_utils import tiny_run, wait_until
from .test_recovery import Node, two_joined

REPO = Path(__file__).resolve().parents[1]


def _ckpt(step: int, value: float, numel: int = 1000) -> Checkpoint:
    return Checkpoint(step=step, params={"w": torch.full((numel,), value)}, optimizer={"state": {}, "param_groups": []},
                      anchors={0: torch.full((numel,), value)}, labels={0: (1, step)})


def _value(ckpt: Checkpoint) -> float:
    return float(ckpt.params["w"][0])


def _killed_at(event: int, root: Path, ckpt: Checkpoint) -> bool:
    """Save `ckpt` in a forked child that dies (os._exit, like kill -9: no cleanup runs) at its `event`-th
    rename, fsync, file write or delete (one file of the folder deleted first); True if the save completed
    before that."""
    pid = os.fork()
    if pid == 0:  # the child
        count = [0]

        def dying(fn, midway=None):
            def wrapper(*args, **kwargs):
                count[0] += 1
                if count[0] == event:
                    if midway is not None:
                        midway(*args)
                    os._exit(9)
                return fn(*args, **kwargs)
            return wrapper

        def first_file_gone(path, *rest) -> None:  # killed in the middle of a delete
            files = sorted(Path(path).glob("*"))
            if files:
                files[0].unlink()

        os.rename, os.fsync = dying(os.rename), dying(os.fsync)
        shutil.rmtree = dying(shutil.rmtree, first_file_gone)
        ckpt_mod.save_file = dying(ckpt_mod.save_file)
        try:
            save_checkpoint(root, ckpt)
        except BaseException:
            os._exit(3)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) in (0, 9), status
    return os.WEXITSTATUS(status) == 0


@pytest.mark.parametrize("same_step", [False, True], ids=["new-step", "same-step"])
def test_a_save_killed_at_any_point_leaves_the_newest_complete_checkpoint_loadable(tmp_path, same_step):
    """The same-step case is `close()` saving again at the step of the last periodic checkpoint: killed between
    moving the old folder aside and renaming the new one in, the step would have vanished."""
    event, completed = 0, False
    while not completed:
        event += 1
        root = tmp_path / f"kill-{event}"
        save_checkpoint(root, _ckpt(1, 1.0))
        save_checkpoint(root, _ckpt(2, 2.0))
        completed = _killed_at(event, root, _ckpt(2, 3.0) if same_step else _ckpt(3, 3.0))
        for path in root.glob("step-*"):  # never a damaged step folder, whatever the instant
            load_checkpoint(path)
        latest = load_latest(root)
        assert latest is not None, f"killed at event {event}: nothing loads"
        assert (latest.step, _value(latest)) in ([(2, 2.0), (2, 3.0)] if same_step else [(2, 2.0), (3, 3.0)]), \
            f"killed at event {event}: loaded step {latest.step} ({_value(latest)}), older than the last complete save"
        save_checkpoint(root, _ckpt(4, 4.0))  # and the next save tidies up after the crash
        assert sorted(p.name for p in root.iterdir()) == [f"step-{latest.step}", "step-4"], f"event {event}"
    assert event > 5  # every rename, fsync and write of a save was a kill point


def test_files_and_folders_are_fsynced_before_the_rename_and_the_parent_after(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, _ckpt(1, 1.0))
    log: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst) -> None:
        log.append(("rename", f"{src} -> {dst}"))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    save_checkpoint(tmp_path, _ckpt(2, 2.0))
    into_place = next(i for i, (op, what) in enumerate(log) if op == "rename" and what.endswith("step-2"))
    before = {Path(what).name for op, what in log[:into_place] if op == "fsync"}
    assert {ckpt_mod.TENSORS, ckpt_mod.MANIFEST} <= before, log
    assert any(n.startswith(".tmp-") for n in before), f"the temporary folder is not fsynced: {log}"
    assert ("fsync", str(tmp_path.resolve())) in log[into_place:], f"the checkpoint folder is not fsynced after: {log}"


def test_a_damaged_newest_checkpoint_is_refused_and_the_previous_good_one_loaded(tmp_path):
    save_checkpoint(tmp_path, _ckpt(1, 1.0))
    save_checkpoint(tmp_path, _ckpt(2, 2.0))
    tensors = tmp_path / "step-2" / ckpt_mod.TENSORS
    data = bytearray(tensors.read_bytes())
    data[-3] ^= 0x10  # one bit in a tensor value: still a valid safetensors file, only the digest knows
    tensors.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="digest"):
        load_checkpoint(tmp_path / "step-2")
    assert (load_latest(tmp_path).step, _value(load_latest(tmp_path))) == (1, 1.0)


def test_pruning_keeps_two_good_checkpoints_after_a_resume_fell_back_from_a_damaged_newer_one(tmp_path):
    """A resume from step 20 (step 30 damaged) saving step 25 must not delete step 20: that would leave one good
    checkpoint, and a second damaged one would leave none."""
    for step in (20, 30):
        save_checkpoint(tmp_path, _ckpt(step, float(step)))
    (tmp_path / "step-30" / ckpt_mod.TENSORS).write_bytes(b"torn")
    assert load_latest(tmp_path).step == 20
    save_checkpoint(tmp_path, _ckpt(25, 25.0))
    good = []
    for path in tmp_path.glob("step-*"):
        try:
            good.append(load_checkpoint(path).step)
        except CheckpointCorrupt:
            pass
    assert sorted(good) == [20, 25]


def test_a_full_disk_fails_the_save_and_leaves_the_last_good_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, _ckpt(1, 1.0))
    real = ckpt_mod.save_file

    def half_then_enospc(tensors, path) -> None:
        real(tensors, path)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_mod, "save_file", half_then_enospc)
    with pytest.raises(OSError) as failed:
        save_checkpoint(tmp_path, _ckpt(2, 2.0))
    assert failed.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    assert _value(load_latest(tmp_path)) == 1.0


@pytest.fixture
def tiny_disk(tmp_path):
    """A 512 KiB tmpfs (root only): a real ENOSPC."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
                                           capture_output=True).returncode:
        pytest.skip("needs root to mount a tmpfs")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_real_full_disk_fails_the_save_and_leaves_the_last_good_checkpoint(tiny_disk):
    save_checkpoint(tiny_disk, _ckpt(1, 1.0, numel=20_000))  # ~160 KB
    filler = tiny_disk / "filler"
    free = os.statvfs(tiny_disk).f_bavail * os.statvfs(tiny_disk).f_frsize
    filler.write_bytes(b"\0" * (free - 40_000))
    with pytest.raises(Exception, match="No space left on device"):
        save_checkpoint(tiny_disk, _ckpt(2, 2.0, numel=20_000))
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["filler", "step-1"]
    assert _value(load_latest(tiny_disk)) == 1.0
    filler.unlink()
    save_checkpoint(tiny_disk, _ckpt(2, 2.0, numel=20_000))
    assert _value(load_latest(tiny_disk)) == 2.0


def test_a_torn_journal_append_is_cut_off_so_later_records_still_replay(tmp_path, monkeypatch):
    journal = Journal(tmp_path)
    journal.update(b"first")
    real = journal_mod._write_all

    def torn(fd, buffers) -> None:  # the disk fills up in the middle of the record
        os.write(fd, bytes(buffers[0])[:5])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal_mod, "_write_all", torn)
    journal.update(b"lost")
    monkeypatch.setattr(journal_mod, "_write_all", real)
    journal.update(b"after")
    assert [body for _, body in records(tmp_path)] == [b"first", b"after"]
    assert journal.failed_writes == 1


def test_a_journal_that_cannot_open_a_new_segment_keeps_appending_to_the_current_one(tmp_path, monkeypatch):
    journal = Journal(tmp_path)
    current = journal.segment
    real_open = os.open

    def full(path, *args, **kwargs):
        if "seg-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", full)
    assert journal.rotate() == current  # (the caller's drop_before(current) then keeps it)
    monkeypatch.setattr(os, "open", real_open)
    journal.update(b"kept")
    assert segments(tmp_path / "journal") == [current]
    assert [body for _, body in records(tmp_path)] == [b"kept"]




def _versions_past(n: Node, labels: list[Version]) -> None:
    for _ in range(30):
        n.train(10)
        if all(a > Version(*b) for a, b in zip(n.labels, labels, strict=True)):
            return
    raise AssertionError(f"no newer versions than {labels}")


@pytest.mark.timeout(120)
def test_a_resume_that_falls_back_to_the_previous_checkpoint_still_replays_every_version(tmp_path, nodes):
    """The newest checkpoint damaged: the older one plus the journal since *it* holds what the learner had."""
    genesis, key, folder = tiny_run(quorum=1), Identity.generate(), tmp_path / "a"
    n = Node(genesis, 0, folder, key).start()
    nodes.append(n)
    _versions_past(n, [(0, 0)] * 4)
    first = n.checkpoint()
    _versions_past(n, list(first.values()))
    second = n.checkpoint()
    _versions_past(n, list(second.values()))
    held = list(n.labels)
    n.kill()
    newest = max(folder.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    (newest / ckpt_mod.TENSORS).write_bytes(b"damaged")
    assert load_latest(folder).labels == first
    back = Node(genesis, 0, folder, key).start()
    nodes.append(back)
    assert back.labels == held, "versions accepted between the two checkpoints were lost with the newest one"


@pytest.mark.timeout(120)
def test_a_full_disk_is_reported_and_training_goes_on_without_harming_the_last_checkpoint(tmp_path, nodes,
                                                                                          monkeypatch):
    genesis, folder = tiny_run(quorum=1), tmp_path / "a"
    n = Node(genesis, 0, folder, Identity.generate()).start()
    nodes.append(n)
    _versions_past(n, [(0, 0)] * 4)
    good = n.checkpoint()
    journaled = segments(folder / "journal")

    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_mod, "save_file", enospc)
    n.learner.save_checkpoint(wait=True)
    storage = n.learner.status()["storage"]
    assert "No space left on device" in storage["checkpoint_error"] and storage["checkpoints_failed"] == 1
    assert n.learner.checkpoint_error == storage["checkpoint_error"]
    assert n.learner.healthy
    step = n.learner.t
    n.train(5)  # training goes on
    assert n.learner.t == step + 5
    assert load_latest(folder).labels == good and min(segments(folder / "journal")) <= min(journaled), \
        "the failed save dropped journal segments the last good checkpoint needs"
    monkeypatch.undo()
    n.learner.save_checkpoint(wait=True)
    assert n.learner.status()["storage"]["checkpoint_error"] is None
    assert load_latest(folder).step == n.learner.t


@pytest.mark.timeout(120)
def test_a_replica_killed_between_checkpoints_comes_back_with_the_momentum_of_the_newest_version(tmp_path, nodes):
    """What a replica holds is its version (journaled) and the owner's momentum (`Replication.kept`): without a
    journal record, a restart has only the checkpoint's older momentum, and an owner taking over from it
    rebuilds, pulls or restarts it."""
    genesis, keys, a, b = two_joined(tmp_path, nodes)
    for _ in range(2):
        for n in (a, b):
            n.train(10)
    wait_until(lambda: all(v.version >= 1 for n in (a, b) for v in n.labels), 30, "a version of every fragment")
    saved = {n: n.checkpoint() for n in (a, b)}

    def newer(n: Node) -> dict:
        """What `n` keeps as a replica of versions newer than its checkpoint's."""
        return {p: (label, m) for p, (label, m) in list(n.learner.swarm.shard.replication.kept.items())
                if m is not None and label == n.labels[p] and label > Version(*saved[n][p])}

    for _ in range(20):
        if newer(a) or newer(b):
            break
        for n in (a, b):
            n.train(10)
    replica = a if newer(a) else b  # (with two members, the one that does not own every fragment)
    store = replica.learner.swarm.store
    kept = {p: (label, m.decode(store.numel(p)).clone()) for p, (label, m) in newer(replica).items()}
    assert kept, "no newer version was replicated"
    b.kill()
    a.kill()
    folder, key = (tmp_path / "a", keys[0]) if replica is a else (tmp_path / "b", keys[1])
    ckpt = load_latest(folder)
    anchors = [ckpt.anchors[p].reshape(-1).clone() for p in range(4)]
    out = replay(folder, genesis.spec, anchors, [Version(*ckpt.labels[p]) for p in range(4)],
                 [ckpt.certs[p] for p in range(4)], set())
    for p, (label, momentum) in kept.items():
        assert out.momenta[p][0] == label and torch.equal(out.momenta[p][1].decode(momentum.numel()), momentum)
    back = Node(genesis, 0 if replica is a else 1, folder, key).start()  # alone: it owns all, from what it kept
    nodes.append(back)
    shard = back.learner.swarm.shard
    wait_until(lambda: all(p in shard.owners and shard.owners[p].momentum is not None for p in kept), 30,
               "owner of the fragments it replicated")
    for p, (label, momentum) in kept.items():
        assert shard.owners[p].label == label and shard.momentum_source[p] == "checkpoint", (p, shard.momentum_source)
        assert torch.equal(shard.owners[p].momentum, momentum)


@pytest.mark.timeout(120)
def test_kill_9_of_real_learner_processes_during_checkpoints_and_replications(tmp_path):
    """A few kills of the benchmark (benchmarks/crash_storage.py), each aimed or random, each checked."""
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "crash_storage.py"), "--kills", "4",
                          "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=110, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["kills"] == 4
    assert result["kills_during_checkpoint"] + result["kills_during_replication"] >= 1, result
    assert result["unloadable_checkpoints"] == 0, result
    assert result["version_regressions"] == 0 and result["regressions_after_rejoin"] == 0, result
    assert result["versions_accepted"] > 0, result
