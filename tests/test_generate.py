"""The task generator (envs/tbench2/generate): families, determinism, splits, cache, CLI.

The sandbox runs (oracle 1.0, empty 0.0, near misses 0.0) are in tests/test_generate_check.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl.config.schema import RunConfig
from agentrl.envs.tasks_cli import app as tasks_app
from agentrl.sandbox.dockerfile import parse_dockerfile
from envs.tbench2.generate.build import (
    MANIFEST,
    draw_instances,
    generate_split_set,
    generate_tasks,
    split_instances,
)
from envs.tbench2.generate.cache import ensure_generated
from envs.tbench2.generate.family import File
from envs.tbench2.generate.registry import KINDS, all_families, families_named
from envs.tbench2.generate.splits import load_heldout_splits
from envs.tbench2.loader import load_splits, load_task

FAMILIES = all_families()


def tree_bytes(root: Path) -> dict[str, tuple]:
    """Every path under root with its kind, mode and bytes (or link target)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_dir():
            out[rel] = ("dir", p.stat().st_mode & 0o7777)
        else:
            out[rel] = ("file", p.stat().st_mode & 0o7777, p.read_bytes())
    return out


def test_at_least_30_families_covering_every_kind():
    assert len(FAMILIES) >= 30
    assert {f.kind for f in FAMILIES.values()} == set(KINDS)
    assert sum(f.kind == "lookup" for f in FAMILIES.values()) >= 3  # look before acting


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_draws_distinct_valid_instances(name):
    fam = FAMILIES[name]
    insts = draw_instances([fam], 12, seed=5)
    assert len({i.fingerprint for i in insts}) == 12
    for inst in insts:
        t = inst.task
        assert t.instruction.strip() and t.solution and t.checks
        assert "/app/" in t.instruction
    # Instances differ in content, not only in names: the files' bytes and the expected results.
    contents = {
        (tuple(sorted(e.content for e in i.task.app.values() if isinstance(e, File))),
         tuple(sorted(i.task.tests.values())),
         tuple(w for c in i.task.checks for w in c.split() if "/app" not in w and "/tests" not in w))
        for i in insts
    }
    assert len(contents) >= 6
    assert len({i.task.instruction.split("`")[0] for i in insts}) >= 2  # more than one phrasing


def test_generated_folders_load_and_use_only_what_the_local_sandbox_interprets(tmp_path):
    generate_tasks(tmp_path / "set", None, 1, seed=3)
    dirs = sorted(p for p in (tmp_path / "set").iterdir() if p.is_dir())
    assert len(dirs) == len(FAMILIES)
    for d in dirs:
        spec = load_task(d)
        assert spec.schema_version == "1.1" and spec.category in KINDS
        assert spec.metadata["family"] == d.name.rsplit("-s3-", 1)[0]
        assert spec.workdir == "/app" and not spec.allow_internet
        plan = parse_dockerfile((d / "environment" / "Dockerfile").read_text())
        assert [u.split(":", 1)[1].split()[0] for u in plan.unsupported] == ["FROM"]
        test_sh = (d / "tests" / "test.sh").read_text()
        assert "echo 1 > /logs/verifier/reward.txt" in test_sh and "echo 0 > /logs/verifier/reward.txt" in test_sh
        assert os.access(d / "tests" / "test.sh", os.X_OK) and os.access(d / "solution" / "solve.sh", os.X_OK)


def test_same_call_writes_byte_identical_folders(tmp_path):
    a = generate_tasks(tmp_path / "a", None, 2, seed=9)
    b = generate_tasks(tmp_path / "b", None, 2, seed=9)
    assert a == b
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")
    generate_tasks(tmp_path / "c", None, 2, seed=10)
    assert tree_bytes(tmp_path / "a") != tree_bytes(tmp_path / "c")
    # The first k instances do not depend on how many are asked for.
    few = draw_instances(families_named(["copy-dir"]), 2, seed=9)
    more = draw_instances(families_named(["copy-dir"]), 5, seed=9)
    assert [i.fingerprint for i in few] == [i.fingerprint for i in more[:2]]


def test_generate_refuses_a_folder_in_use(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        generate_tasks(tmp_path / "x", ["make-dir"], 1, 0)
    with pytest.raises(ValueError, match="unknown task families"):
        generate_tasks(tmp_path / "y", ["no-such-family"], 1, 0)


# -- held-out splits ------------------------------------------------------------------------------


def test_the_repo_splits_are_disjoint_and_cover_every_family():
    s = load_heldout_splits()
    assert not set(s.train_families) & set(s.heldout_families)
    assert set(s.train_families) | set(s.heldout_families) == set(FAMILIES)
    assert len(s.heldout_families) >= 8
    # Held-out families span several kinds, each with a training sibling of the same kind.
    held_kinds = {FAMILIES[f].kind for f in s.heldout_families}
    assert len(held_kinds) >= 6
    assert held_kinds <= {FAMILIES[f].kind for f in s.train_families}


def test_split_sets_never_share_a_family_or_an_instance():
    sets = split_instances(instances=16, seed=0)
    train, held_fam, held_inst = sets["train"], sets["eval"], sets["eval_instances"]
    assert not {i.family.name for i in train} & {i.family.name for i in held_fam}
    assert {i.family.name for i in held_inst} == {i.family.name for i in train}
    assert not {i.fingerprint for i in train} & {i.fingerprint for i in held_inst}
    ids = [i.task_id for v in sets.values() for i in v]
    assert len(ids) == len(set(ids))


def test_a_training_draw_that_repeats_a_heldout_instance_is_redrawn():
    s = load_heldout_splits()
    fams = families_named(s.train_families[:3])
    held = draw_instances(fams, 2, s.heldout_instance_seed)
    # The same seed would draw exactly the held-out instances; exclusion forces new ones.
    again = draw_instances(fams, 2, s.heldout_instance_seed, exclude=[i.fingerprint for i in held])
    assert not {i.fingerprint for i in held} & {i.fingerprint for i in again}
    with pytest.raises(ValueError, match="held-out seeds"):
        split_instances(instances=1, seed=s.heldout_instance_seed)


def test_split_set_folder_has_splits_the_env_reads(tmp_path):
    generate_split_set(tmp_path / "s", instances=1, seed=0)
    splits = load_splits(tmp_path / "s")
    s = load_heldout_splits()
    assert len(splits["train"]) == len(s.train_families)
    assert len(splits["eval"]) == len(s.heldout_families) * s.heldout_instances
    assert len(splits["eval_instances"]) == len(s.train_families) * s.heldout_instances
    manifest = json.loads((tmp_path / "s" / MANIFEST).read_text())
    assert set(manifest["tasks"]) == {t for v in splits.values() for t in v}


# -- cache and config -----------------------------------------------------------------------------


def test_cache_builds_once_and_rebuilds_the_same_bytes(tmp_path):
    first = ensure_generated(["count-lines", "make-dir"], 2, 4, cache_dir=tmp_path)
    stamp = (first / MANIFEST).stat().st_mtime_ns
    before = tree_bytes(first)
    assert ensure_generated(["count-lines", "make-dir"], 2, 4, cache_dir=tmp_path) == first
    assert (first / MANIFEST).stat().st_mtime_ns == stamp  # found, not rebuilt
    assert ensure_generated(["count-lines", "make-dir"], 2, 5, cache_dir=tmp_path) != first
    import shutil

    shutil.rmtree(first)  # a wiped cache: the resumed run rebuilds the very same set
    assert ensure_generated(["count-lines", "make-dir"], 2, 4, cache_dir=tmp_path) == first
    assert tree_bytes(first) == before
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_cache_refuses_a_foreign_folder_at_its_key(tmp_path):
    target = ensure_generated(["make-dir"], 1, 0, cache_dir=tmp_path)
    import shutil

    shutil.rmtree(target)
    target.mkdir()
    with pytest.raises(FileExistsError, match="not a generated set"):
        ensure_generated(["make-dir"], 1, 0, cache_dir=tmp_path)


def test_recipe_field_builds_the_set_for_the_tbench2_env(tmp_path):
    from envs.tbench2.env import TB2Env

    cfg = RunConfig.model_validate({"env": {"generate": {"instances": 1, "seed": 2, "cache_dir": str(tmp_path)}}})
    env = TB2Env.from_config(cfg)
    assert env.tasks_dir.parent == tmp_path
    splits = env.splits()
    assert set(splits) == {"train", "eval", "eval_instances"}
    assert set(env.task_ids()) == {t for v in splits.values() for t in v}
    with pytest.raises(ValueError, match="env.generate and env.tasks_dir"):
        RunConfig.model_validate({"env": {"tasks_dir": str(tmp_path), "generate": {}}})


# -- CLI --------------------------------------------------------------------------------------------


def test_cli_generates_lists_and_names_bad_input(tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli"
    r = runner.invoke(tasks_app, ["generate", str(out), "--families", "count-words,make-dir",
                                  "--instances", "2", "--seed", "3"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "count-words-s3-000", "count-words-s3-001", "make-dir-s3-000", "make-dir-s3-001"]
    r = runner.invoke(tasks_app, ["generate", "--list"])
    assert r.exit_code == 0 and "count-words" in r.output and "held-out" in r.output
    r = runner.invoke(tasks_app, ["generate", str(tmp_path / "bad"), "--families", "nope"])
    assert r.exit_code == 2 and "unknown task families ['nope']" in r.output
    r = runner.invoke(tasks_app, ["generate", str(tmp_path / "both"), "--splits", "--families", "make-dir"])
    assert r.exit_code != 0 and "--splits" in r.output
