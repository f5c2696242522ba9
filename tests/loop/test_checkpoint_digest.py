"""Damaged checkpoint files are detected, never used (loop/digest.py: the ``.sha256`` sidecar)."""

import hashlib
import os
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from ampkit import MixedPrecision
from ampkit.loop.checkpoint import (
    CheckpointError,
    CheckpointManager,
    digest_path,
    load_checkpoint,
    save_checkpoint,
)
from ampkit.models.builtin import builtin
from ampkit.train.trainer import Trainer


def flip_tensor_byte(path: str) -> None:
    """Flip one bit in the middle of the largest tensor's bytes (its record in torch's zip archive):
    the archive stays readable and ``torch.load`` does not check the record's CRC-32."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        pos = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x04]))


def flip_shard_byte(directory, fqn: str):
    """Flip one bit in the middle of tensor ``fqn``'s bytes in its DCP shard file; returns it."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(directory)).read_metadata()
    [info] = [v for k, v in meta.storage_data.items() if k.fqn == fqn]
    shard = directory / info.relative_path
    with open(shard, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)[0]
        f.seek(info.offset + info.length // 2)
        f.write(bytes([byte ^ 0x04]))
    return shard


def make_trainer(directory, seed=0):
    torch.manual_seed(seed)
    model, data = builtin("gpt", "tiny", batch_size=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp = MixedPrecision("fp16", device="cpu", init_scale=2.0**12, growth_interval=3)
    model, opt = amp.setup(model, opt)
    return Trainer(
        model,
        opt,
        amp,
        data,
        progress=False,
        log_every=2,
        diagnose=False,
        checkpoint_dir=str(directory),
        checkpoint_every=2,
    )


def test_sidecar_is_the_files_sha256_in_sha256sum_format(tmp_path):
    path = str(tmp_path / "a.pt")
    save_checkpoint({"x": torch.arange(5)}, path)
    with open(path, "rb") as f:
        want = hashlib.sha256(f.read()).hexdigest()
    assert (tmp_path / "a.pt.sha256").read_text() == f"{want}  a.pt\n"
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "a.pt.sha256"]  # no temporary file left


def test_flipped_byte_in_the_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path):
    """Without the digest the damaged step-4 checkpoint loads silently (a wrong weight); with it the
    step-2 one is used, and the run continues bitwise as if resumed from that one."""
    first = make_trainer(tmp_path / "a")
    first.fit(4)
    a, b = tmp_path / "a", tmp_path / "b"
    assert [os.path.basename(p) for _, p in CheckpointManager(str(a)).list()] == [
        "ckpt-00000002.pt",
        "ckpt-00000004.pt",
    ]
    b.mkdir()
    for f in a.glob("ckpt-00000002.pt*"):  # the file and its digest
        shutil.copy(f, b / f.name)
    flip_tensor_byte(str(a / "ckpt-00000004.pt"))

    damaged = make_trainer(a, seed=1)
    with pytest.warns(
        UserWarning,
        match=r"ckpt-00000004\.pt' is damaged: its SHA-256 .* does not match .*"
        r"falling back to the previous checkpoint '.*ckpt-00000002\.pt'",
    ):
        assert damaged.resume() == str(a / "ckpt-00000002.pt")
    clean = make_trainer(b, seed=1)
    assert clean.resume() == str(b / "ckpt-00000002.pt")
    assert damaged.amp.optimizer_steps == clean.amp.optimizer_steps == 2
    damaged.fit(2)
    clean.fit(2)
    for (k, x), y in zip(damaged.model.state_dict().items(), clean.model.state_dict().values()):
        assert torch.equal(x, y), k
    assert damaged.amp.stats()["scale"] == clean.amp.stats()["scale"]
    load_checkpoint(
        str(a / "ckpt-00000004.pt")
    )  # rewritten over the damaged one, with its own digest


def test_the_only_checkpoint_damaged_is_an_error_naming_it(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    mgr.save(1, {"w": torch.arange(4096, dtype=torch.float32)})
    flip_tensor_byte(mgr.path(1))
    with pytest.raises(
        CheckpointError, match=r"ckpt-00000001\.pt' is damaged: its SHA-256 .* does not match"
    ):
        load_checkpoint(mgr.path(1))
    with pytest.raises(
        CheckpointError,
        match=r"damaged or unreadable \(1 file\(s\)\), so none was loaded: .*"
        r"ckpt-00000001\.pt' is damaged.*; to go on, restore a checkpoint of this run from a "
        r"backup, or start the run afresh in another directory",
    ):
        mgr.load_latest()  # never None: that would be a silent fresh start


def test_without_a_sidecar_a_checkpoint_loads_unverified_and_a_damaged_sidecar_refuses(tmp_path):
    path = str(tmp_path / "ckpt-00000001.pt")
    save_checkpoint({"w": torch.ones(3)}, path)
    sidecar = digest_path(path)
    os.unlink(
        sidecar
    )  # a checkpoint written before digests, copied alone, or a crash between the renames
    assert torch.equal(load_checkpoint(path)["w"], torch.ones(3))
    with open(sidecar, "w") as f:
        f.write("not a digest\n")
    with pytest.raises(
        CheckpointError,
        match=r"ckpt-00000001\.pt' has a damaged digest file "
        r"\(ckpt-00000001\.pt\.sha256: no SHA-256 in it\)",
    ):
        load_checkpoint(path)


def test_a_checkpoint_that_lost_its_digest_beside_ones_that_have_theirs_is_never_used(
    tmp_path, caplog
):
    """ampkit writes a checkpoint's digest before the checkpoint takes its name, so in a directory
    whose checkpoints carry digests, one without its own lost it (deleted, copied alone): its bytes
    cannot be verified (here a flipped byte), so it is reported and the previous one is used. A
    directory of checkpoints without any digest (written before ampkit recorded them) still loads,
    with a warning that says it is unverified."""
    mgr = CheckpointManager(str(tmp_path / "a"), keep_last=None)
    for s in (1, 2):
        mgr.save(s, {"w": torch.full((4096,), float(s))})
    flip_tensor_byte(mgr.path(2))
    os.unlink(digest_path(mgr.path(2)))
    with pytest.raises(CheckpointError, match=r"ckpt-00000002\.pt' has no digest file .*beside it"):
        load_checkpoint(mgr.path(2))
    with pytest.warns(
        UserWarning,
        match=r"ckpt-00000002\.pt' has no digest file.*previous "
        r"checkpoint '.*ckpt-00000001\.pt'",
    ):
        path, state = mgr.load_latest()
    assert path == mgr.path(1) and torch.equal(state["w"], torch.full((4096,), 1.0))

    old = tmp_path / "old"
    save_checkpoint({"w": torch.ones(3)}, str(old / "ckpt-00000001.pt"))
    os.unlink(digest_path(str(old / "ckpt-00000001.pt")))
    with pytest.warns(UserWarning, match=r"ckpt-00000001\.pt' has no digest file .*unverified"):
        assert torch.equal(load_checkpoint(str(old / "ckpt-00000001.pt"))["w"], torch.ones(3))


def test_the_digest_is_in_place_before_the_checkpoint_takes_its_name(tmp_path, monkeypatch):
    """A process killed between the two renames leaves no checkpoint without its digest: the digest
    comes first (a digest left beside an older file of that name does not match it: reported)."""
    import ampkit.loop.checkpoint as ck

    seen = []
    real = os.replace

    def replace(src, dst):
        if str(dst).endswith(".pt"):
            seen.append(os.path.exists(str(dst) + ".sha256"))
        return real(src, dst)

    monkeypatch.setattr(ck.os, "replace", replace)
    save_checkpoint({"x": torch.arange(3)}, str(tmp_path / "ckpt-00000001.pt"))
    assert seen == [True]


@pytest.mark.parametrize("older", [False, True])
def test_a_failed_rename_leaves_the_digests_as_they_were(tmp_path, monkeypatch, older):
    """ "Nothing was replaced" holds for the sidecar too: when the checkpoint's own rename fails
    (a full disk, a read-only remount), the digest written just before it is taken back -- the
    older file of that name keeps its own digest and loads; with none, no stray digest stays."""
    import errno

    import ampkit.loop.checkpoint as ck

    path = str(tmp_path / "ckpt-00000003.pt")
    if older:
        save_checkpoint({"x": torch.arange(3)}, path)
    before = Path(digest_path(path)).read_bytes() if older else None
    real = os.replace

    def replace(src, dst):
        if str(dst) == path:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(src, dst)

    monkeypatch.setattr(ck.os, "replace", replace)
    with pytest.raises(CheckpointError, match="Nothing was replaced"):
        save_checkpoint({"x": torch.arange(5)}, path)
    monkeypatch.undo()
    if older:
        assert Path(digest_path(path)).read_bytes() == before
        assert torch.equal(load_checkpoint(path)["x"], torch.arange(3))
    else:
        assert not os.path.exists(digest_path(path))
    assert sorted(os.listdir(tmp_path)) == (
        ["ckpt-00000003.pt", "ckpt-00000003.pt.sha256"] if older else []
    )


def test_digests_follow_their_checkpoints(tmp_path):
    """keep_last removes a checkpoint's digest with it; temporary ones are cleaned; a digest left
    without its checkpoint is never read (saving that step replaces it); saving the same step again
    replaces the digest too."""
    mgr = CheckpointManager(str(tmp_path), keep_last=2)
    (tmp_path / ".tmp-dead.sha256").write_text("partial")
    (tmp_path / "ckpt-00000001.pt.sha256").write_text(
        "0" * 64 + "  ckpt-00000001.pt\n"
    )  # an orphan
    for s in range(1, 4):
        mgr.save(s, {"s": s})
        assert load_checkpoint(mgr.path(s))["s"] == s  # verified against its own digest
    mgr.save(3, {"s": 33})
    assert sorted(os.listdir(tmp_path)) == [
        "ckpt-00000002.pt",
        "ckpt-00000002.pt.sha256",
        "ckpt-00000003.pt",
        "ckpt-00000003.pt.sha256",
    ]
    assert mgr.load_latest()[1]["s"] == 33


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_checkpoint_with_a_flipped_byte_is_reported_and_the_previous_one_used(tmp_path):
    """The sharded (DCP) form, in one process: every file of a checkpoint directory is listed with
    its SHA-256 in ``.sha256`` inside it; a shard with a flipped byte makes the directory
    damaged."""
    from ampkit.distributed import dcp
    from ampkit.distributed.states import capture
    from ampkit.loop.checkpoint import ShardedCheckpointManager, export_single_file

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    mgr = ShardedCheckpointManager(str(tmp_path), lambda: capture(model, opt))
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(float(step))
        mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": {}})
    newest = tmp_path / "ckpt-00000002"
    listed = (newest / dcp.DIGESTS).read_text().splitlines()
    assert sorted(line.split("  ")[1] for line in listed) == sorted(
        p.name for p in newest.iterdir() if p.name != dcp.DIGESTS
    )
    assert dcp.verify(str(newest)) is None
    shard = flip_shard_byte(newest, "model.weight")
    with pytest.warns(
        UserWarning,
        match=rf"ckpt-00000002' is damaged: the SHA-256 of {shard.name} does not match"
        r".*falling back to the previous checkpoint '.*ckpt-00000001'",
    ):
        path, state = mgr.load_latest()
    assert path == str(tmp_path / "ckpt-00000001") and torch.equal(
        state["model"]["weight"], torch.full((64, 64), 1.0)
    )
    with pytest.raises(
        CheckpointError, match=rf"damaged: the SHA-256 of {shard.name} does not match"
    ):
        export_single_file(str(newest), str(tmp_path / "one.pt"))


def _sharded_job(rank: int, world: int, directory: str) -> dict:
    import warnings

    import torch.distributed as dist

    from ampkit.distributed.states import capture
    from ampkit.loop.checkpoint import ShardedCheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    mgr = ShardedCheckpointManager(directory, lambda: capture(model, opt))
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(float(step))
        mgr.save(
            step,
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "amp": {},
                "rng": {"r": rank},
            },
        )
    if rank == 0:
        from pathlib import Path

        flip_shard_byte(Path(directory) / "ckpt-00000002", "model.weight")
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, state = mgr.load_latest()
    return {
        "path": path,
        "weight": state["model"]["weight"],
        "rng": state["rng"],
        "warnings": [str(w.message) for w in caught if "falling back" in str(w.message)],
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_checkpoint_damage_is_seen_by_every_rank_alike(tmp_path):
    """Two ranks hash a share of the files each, at save and at load; both fall back together."""
    from ..support.dist_helpers import run_ranks

    ranks = run_ranks(_sharded_job, str(tmp_path))
    for r, out in enumerate(ranks):
        assert out["path"] == str(tmp_path / "ckpt-00000001") and out["rng"] == {"r": r}
        assert torch.equal(out["weight"], torch.full((64, 64), 1.0))
        assert len(out["warnings"]) == 1 and "ckpt-00000002' is damaged" in out["warnings"][0]


@pytest.mark.parametrize("given", ["file", "single_dir", "sharded_dir", "missing", "empty"])
def test_export_names_what_it_was_given_and_what_to_pass(given, tmp_path):
    """``ampkit export`` given what a user has at hand (a single-file checkpoint, a --checkpoint_dir
    of them, a multi-process run's --checkpoint_dir, a typo) says what it is and what to pass
    (it said 'not a directory' of a file that is a checkpoint, and 'no .metadata' of a folder of
    them); only a sharded checkpoint directory is exported."""
    from ampkit.distributed.states import capture
    from ampkit.loop.checkpoint import (
        CheckpointManager,
        ShardedCheckpointManager,
        export_single_file,
    )

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": {}}
    ck = tmp_path / "ck"
    if given in ("file", "single_dir"):
        mgr = CheckpointManager(str(ck))
        for step in (2, 4):
            mgr.save(step, state)
    elif given == "sharded_dir":
        mgr = ShardedCheckpointManager(str(ck), lambda: capture(model, opt))
        for step in (2, 4):
            mgr.save(step, state)
    elif given == "empty":
        ck.mkdir()
    source = {"file": ck / "ckpt-00000004.pt"}.get(given, ck)
    words = {
        "file": ["is a single-file checkpoint already", "torch.load"],
        "single_dir": ["holds single-file checkpoints", "ckpt-00000004.pt", "nothing to export"],
        "sharded_dir": ["holds sharded checkpoints", str(ck / "ckpt-00000004")],
        "missing": ["does not exist"],
        "empty": ["holds no checkpoint", ".metadata"],
    }[given]
    with pytest.raises(CheckpointError) as e:
        export_single_file(str(source), str(tmp_path / "one.pt"))
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert not (tmp_path / "one.pt").exists()
    if given == "sharded_dir":  # the newest one, passed as the error says, exports
        assert export_single_file(str(ck / "ckpt-00000004"), str(tmp_path / "one.pt"))


def _two_sharded(directory):
    """Sharded checkpoints of steps 1 and 2 (weights 1.0 and 2.0) in ``directory``, in one process."""
    from ampkit.distributed.states import capture
    from ampkit.loop.checkpoint import ShardedCheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    mgr = ShardedCheckpointManager(str(directory), lambda: capture(model, opt), keep_last=None)
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(float(step))
        mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": {}})
    return mgr


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("case", ["no_list", "missing_line"])
def test_a_sharded_checkpoint_that_lost_its_list_or_a_line_of_it_is_never_used(tmp_path, case):
    """As for single files: every file of a sharded checkpoint must be listed in its ``.sha256``
    and match. A directory without the list beside checkpoints that have theirs lost it; a file
    not in the list cannot be verified: either is refused (here a flipped byte hides behind it),
    the previous checkpoint used, and ``ampkit export`` refuses it too (it wrote a fresh, valid
    digest for the damaged bytes)."""
    from ampkit.distributed import dcp
    from ampkit.loop.checkpoint import export_single_file

    mgr = _two_sharded(tmp_path / "ck")
    newest = tmp_path / "ck" / "ckpt-00000002"
    shard = flip_shard_byte(newest, "model.weight")
    listing = newest / dcp.DIGESTS
    if case == "no_list":
        listing.unlink()
        why = r"has no digest list \(\.sha256 inside it\) although .*have theirs"
    else:
        lines = [ln for ln in listing.read_text().splitlines() if not ln.endswith(shard.name)]
        listing.write_text("".join(ln + "\n" for ln in lines))
        why = rf"is damaged: {shard.name} is not in its digest list"
    with pytest.warns(
        UserWarning, match=why + r".*falling back to the previous checkpoint '.*ckpt-00000001'"
    ):
        path, state = mgr.load_latest()
    assert path == mgr.path(1) and torch.equal(state["model"]["weight"], torch.full((64, 64), 1.0))
    with pytest.raises(CheckpointError, match=why):
        export_single_file(str(newest), str(tmp_path / "one.pt"))
    assert not (tmp_path / "one.pt").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_checkpoints_without_any_list_load_unverified_with_a_warning(tmp_path):
    """Written before ampkit recorded digests (no list in any of them): they load, and export, with
    a warning that says they are unverified."""
    from ampkit.distributed import dcp
    from ampkit.loop.checkpoint import export_single_file, load_checkpoint

    mgr = _two_sharded(tmp_path / "ck")
    for step in (1, 2):
        (tmp_path / "ck" / f"ckpt-0000000{step}" / dcp.DIGESTS).unlink()
    unverified = r"ckpt-00000002' has no digest list .*nor do the checkpoints beside it.*unverified"
    with pytest.warns(UserWarning, match=unverified):
        path, state = mgr.load_latest()
    assert path == mgr.path(2) and torch.equal(state["model"]["weight"], torch.full((64, 64), 2.0))
    with pytest.warns(UserWarning, match=unverified):
        export_single_file(mgr.path(2), str(tmp_path / "one.pt"))
    assert torch.equal(
        load_checkpoint(str(tmp_path / "one.pt"))["model"]["weight"], torch.full((64, 64), 2.0)
    )
