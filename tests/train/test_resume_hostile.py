"""A hand-edited or damaged checkpoint is one line and exit 2 for ``train --resume``, ``sample`` and
``export``: meta.json of the wrong structure (re-signed into manifest.json, so it reaches its
readers), a manifest that omits the files every checkpoint has, and DCP/RNG files that pass the
manifest but cannot be read (no torch traceback on stderr)."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import pytest

from luban.train import checkpoint
from tests.train.conftest import luban, tiny_overrides


def sets(overrides):
    return sum((["--set", o] for o in overrides), [])


@pytest.fixture(scope="module")
def trained(small_dataset, tmp_path_factory) -> Path:
    """One tiny checkpoint (2 steps), built once for the module."""
    root = tmp_path_factory.mktemp("hostile")
    luban("train", *sets(tiny_overrides(small_dataset, root / "run", **{"train.steps": 2, "train.eval_every": 0})),
          check=0)
    ckpt = root / "run" / "checkpoints" / "step_0000002"
    assert checkpoint.verify(ckpt) is None
    return ckpt


def sign(ckpt: Path) -> None:
    """manifest.json as a save writes it, over the folder's current files."""
    files = {f.name: {"bytes": f.stat().st_size, "crc32": zlib.crc32(f.read_bytes()) & 0xFFFFFFFF}
             for f in sorted(ckpt.iterdir()) if f.is_file() and f.name != "manifest.json"}
    (ckpt / "manifest.json").write_text(json.dumps({"files": files}))


def copy(trained: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained, ckpt)
    return ckpt


def one_line(proc, *words) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("luban: error: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def resume(small_dataset, tmp_path, ckpt):
    return luban("train", "--resume", ckpt,
                 *sets(tiny_overrides(small_dataset, tmp_path / "run2", **{"train.steps": 4, "train.eval_every": 0})))


def _edit(meta, how):
    if how == "list":
        return []
    if how == "no-config":
        del meta["config"]
    elif how == "config-5":
        meta["config"] = 5
    elif how == "model-null":
        meta["config"]["model"] = None
    elif how == "loader-x":
        meta["loader"] = "x"
    elif how == "step-abc":
        meta["step"] = "abc"
    elif how == "step-negative":
        meta["step"] = -5
    elif how == "no-loader":
        del meta["loader"]
    elif how == "consumed-text":
        meta["loader"]["consumed_samples"] = "8"
    elif how == "world-0":
        meta["world_size"] = 0
    elif how == "step-huge":  # (2026-12-04: accepted, "resumed at step 1000000000000000000000000000000")
        meta["step"] = 10**30
    elif how == "consumed-huge":  # (2026-12-04: accepted, the run went on at epoch ~10**25 of its data)
        meta["loader"]["consumed_samples"] = 10**30
    return meta


META_CASES = {  # how -> words the line must hold
    "list": ["meta.json = []"],
    "no-config": ["meta.json has no config"],
    "config-5": ["meta.json config = 5"],
    "model-null": ["meta.json config.model = None"],
    "loader-x": ["meta.json loader = 'x'"],
    "step-abc": ["meta.json step = 'abc'", "a whole number from 0 to 100000000"],
    "step-negative": ["meta.json step = -5", "a whole number from 0 to 100000000"],
    "step-huge": ["meta.json step = 1000000000000000000000000000000: a whole number from 0 to 100000000"],
    "no-loader": ["meta.json has no loader"],
    "consumed-text": ["meta.json loader.consumed_samples = '8'"],
    "consumed-huge": ["meta.json loader.consumed_samples = 1000000000000000000000000000000: a whole number from 0 to "
                      "104857600000000 (train.steps x train.global_batch at most)"],
    "world-0": ["meta.json world_size = 0"],
}


@pytest.mark.parametrize("how", list(META_CASES))
def test_meta_json_of_the_wrong_structure_is_one_line(trained, small_dataset, tmp_path, how):
    ckpt = copy(trained, tmp_path)
    meta = _edit(json.loads((ckpt / "meta.json").read_text()), how)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    sign(ckpt)
    one_line(resume(small_dataset, tmp_path, ckpt), f"--resume = {str(ckpt)!r}", *META_CASES[how])
    if how in ("list", "step-negative", "model-null"):  # sample shares the check (verify)
        one_line(luban("sample", ckpt, "--tokens", 2), *META_CASES[how])


def test_a_step_folder_whose_meta_names_another_step_is_refused(trained, small_dataset, tmp_path):
    """(2026-12-04) ``"step": 100`` in ``step_0000002/meta.json`` resumed at step 100; retention and
    ``--resume auto`` order checkpoints by their folders' names. A folder of another name may hold any step."""
    ckpt = tmp_path / "step_0000004"
    shutil.copytree(trained, ckpt)
    one_line(resume(small_dataset, tmp_path, ckpt), f"--resume = {str(ckpt)!r}",
             "meta.json step = 2: 4, the step its folder step_0000004 names (edited or damaged)")
    assert checkpoint.verify(ckpt).startswith("meta.json step = 2: 4")  # --resume auto skips it


@pytest.mark.parametrize("key, value", [("train.seed", 5), ("data.seq_len", 16)])
def test_a_resume_with_another_sample_order_names_the_setting(trained, small_dataset, tmp_path, key, value):
    """(2026-12-04) It said ``loader state_dict['seed'] = 0: must equal this loader's 5``: no setting a user has."""
    proc = luban("train", "--resume", trained, *sets(tiny_overrides(small_dataset, tmp_path / "run2", **{
        "train.steps": 4, "train.eval_every": 0, key: value})))
    line = one_line(proc, f"{key} = {value}: ", "as in the checkpoint --resume names", f"resume with {key} = ")
    assert "state_dict" not in line


def _damage(ckpt: Path, how: str) -> None:
    if how == "empty-manifest":
        (ckpt / "__0_0.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes()[:1000])
        (ckpt / "manifest.json").write_text(json.dumps({"files": {}}))
        return
    if how == "manifest-without-rng":
        sign(ckpt)
        files = json.loads((ckpt / "manifest.json").read_text())
        del files["files"]["rng_rank0.pt"]
        (ckpt / "manifest.json").write_text(json.dumps(files))
        return
    if how == "truncated-distcp":
        (ckpt / "__0_0.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes()[:1000])
    elif how == "random-rng":
        (ckpt / "rng_rank0.pt").write_bytes(bytes(range(256)) * 8)
    elif how == "random-metadata":
        (ckpt / ".metadata").write_bytes(b"x" * 3000)
    sign(ckpt)  # the damage passes the manifest: the readers must refuse it


DAMAGE_CASES = {
    "empty-manifest": ["manifest.json does not list meta.json"],
    "manifest-without-rng": ["manifest.json does not list rng_rank0.pt"],
    "truncated-distcp": ["cannot be read", "EOFError"],
    "random-rng": ["rng_rank0.pt cannot be read"],
    "random-metadata": ["cannot be read"],
}


@pytest.mark.parametrize("how", list(DAMAGE_CASES))
def test_unreadable_files_or_a_manifest_that_omits_them_are_one_line(trained, small_dataset, tmp_path, how):
    ckpt = copy(trained, tmp_path)
    _damage(ckpt, how)
    line = one_line(resume(small_dataset, tmp_path, ckpt), f"--resume = {str(ckpt)!r}", *DAMAGE_CASES[how])
    assert "Traceback" not in line
    if how in ("empty-manifest", "random-metadata"):  # no torch traceback from sample/export either
        one_line(luban("sample", ckpt, "--tokens", 2))
        one_line(luban("export", ckpt, "--format", "hf", tmp_path / "hf"))


def test_the_manifest_must_list_every_file_a_load_reads(trained, tmp_path):
    ckpt = copy(trained, tmp_path)
    (ckpt / "manifest.json").write_text(json.dumps({"files": {}}))
    assert checkpoint.verify(ckpt) == "manifest.json does not list meta.json"
    sign(ckpt)
    (ckpt / "__1_0.distcp").write_bytes(b"unlisted")
    assert checkpoint.verify(ckpt) == "manifest.json does not list __1_0.distcp"
    (ckpt / "__1_0.distcp").unlink()
    assert checkpoint.verify(ckpt) is None
    assert checkpoint.latest_valid(tmp_path / "nothing") is None


def test_ranks_share_the_checksum_reads_and_a_bad_file_in_any_share_is_found(trained, small_dataset, tmp_path,
                                                                            monkeypatch):
    """Every rank read the whole checkpoint to verify it at resume (N ranks, N times the bytes from a
    shared file system; found 2026-11-27). Each rank now checksums its share of the files; the shares
    cover every file once, a damaged file is found by the rank whose share holds it, and a two-rank
    resume names it in one line on every rank (``verify_everywhere``)."""
    ckpt = copy(trained, tmp_path)
    read: list[list[str]] = []
    crc32 = checkpoint.file_crc32
    monkeypatch.setattr(checkpoint, "file_crc32", lambda f: read[-1].append(f.name) or crc32(f))
    for rank in range(3):
        read.append([])
        assert checkpoint.verify(ckpt, share=(rank, 3)) is None
    listed = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert sorted(sum(read, [])) == sorted(listed) and all(read)  # each file once, no share empty
    victim = read[1][0]
    (ckpt / victim).write_bytes(bytes(b ^ 1 for b in (ckpt / victim).read_bytes()))
    assert checkpoint.verify(ckpt, share=(0, 3)) is None and checkpoint.verify(ckpt, share=(2, 3)) is None
    assert checkpoint.verify(ckpt, share=(1, 3)) == f"{victim} fails its CRC32 check"
    monkeypatch.undo()
    out = luban("train", "--resume", ckpt, "--nproc", "2", *sets(tiny_overrides(
        small_dataset, tmp_path / "run2", **{"train.steps": 4, "train.eval_every": 0, "parallel.dp": 2})))
    one_line(out, f"checkpoint is not valid: {victim} fails its CRC32 check")  # every rank found it; rank 0 says it


def test_the_manifest_takes_the_ranks_checksums_of_their_own_files(tmp_path, monkeypatch):
    """Rank 0 fsynced and checksummed every file of every save (the whole checkpoint read back by one
    rank; found 2026-11-27): each rank now reports its own DCP data files and RNG state, and rank 0
    reads only what no rank reported. The manifest is the same as one rank reading everything."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "__10_0.distcp", "rng_rank0.pt", "rng_rank1.pt",
                 "meta.json"):
        (ckpt / name).write_bytes(name.encode() * 3)
    assert checkpoint._own_files(ckpt) == ["__0_0.distcp", "rng_rank0.pt"]  # rank 0 of no group
    whole = checkpoint.file_entries(ckpt, sorted(p.name for p in ckpt.iterdir()))
    others = checkpoint.file_entries(ckpt, ["__1_0.distcp", "__10_0.distcp", "rng_rank1.pt"])
    read: list[str] = []
    crc32 = checkpoint.file_crc32
    monkeypatch.setattr(checkpoint, "file_crc32", lambda f: read.append(f.name) or crc32(f))
    checkpoint.write_manifest(ckpt, others)
    assert sorted(read) == [".metadata", "__0_0.distcp", "meta.json", "rng_rank0.pt"]
    assert json.loads((ckpt / "manifest.json").read_text())["files"] == whole


def test_an_intact_copy_still_resumes(trained, small_dataset, tmp_path):
    ckpt = copy(trained, tmp_path)
    out = resume(small_dataset, tmp_path, ckpt)
    assert out.returncode == 0, out.stderr
    assert f"resumed from {ckpt} at step 2" in out.stdout


def test_retention_and_stale_temps_never_delete_a_users_file(tmp_path):
    """A checkpoint folder holding a file luban did not write is kept by the retention, and a stale
    ``.tmp-`` folder holding one stops the save with one line instead of being deleted (both were
    deleted: a hostile sweep, 2026-11-27)."""
    import torch

    from luban.errors import CheckpointWriteError

    root, state = tmp_path / "checkpoints", {"w": torch.zeros(3)}

    def meta(step):
        return {"step": step, "config": {"model": {}}, "world_size": 1}
    checkpoint.save(root, 1, state, meta(1), keep=1)
    mine = root / "step_0000001" / "mine.txt"
    mine.write_text("mine")
    checkpoint.save(root, 2, state, meta(2), keep=1)
    checkpoint.save(root, 3, state, meta(3), keep=1)
    assert mine.read_text() == "mine" and sorted(p.name for p in root.iterdir()) == ["step_0000001", "step_0000003"]
    stale = root / ".tmp-step_0000004"
    stale.mkdir()
    (stale / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointWriteError, match=r"\.tmp-step_0000004 holds 'notes\.txt', which luban did not write"):
        checkpoint.save(root, 4, state, meta(4), keep=1)
    assert (stale / "notes.txt").read_text() == "mine" and not (root / "step_0000004").exists()
    shutil.rmtree(stale)
    checkpoint.save(root, 4, state, meta(4), keep=1)  # luban's own stale temp (none now) and retention as before
    assert sorted(p.name for p in root.iterdir()) == ["step_0000001", "step_0000004"]
