"""Generated tasks in real local sandboxes: `agentrl tasks check` (oracle 1.0, empty 0.0) and near
misses (the almost-right answers a small model gives) scoring 0.0."""

from __future__ import annotations

import re
import shutil
import uuid

import pytest

from agentrl.config.schema import SandboxConfig
from agentrl.sandbox.local import LocalSandboxProvider
from envs.tbench2.check import check_tasks
from envs.tbench2.generate.build import draw_instances, generate_split_set, generate_tasks, write_set
from envs.tbench2.generate.registry import all_families, families_named
from envs.tbench2.loader import load_splits, load_task
from envs.tbench2.scorer import SCORED, score_task

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


@pytest.fixture
async def provider(tmp_path):
    p = LocalSandboxProvider(SandboxConfig(), run_id=f"gen{uuid.uuid4().hex[:6]}", root_dir=tmp_path / "boxes")
    yield p
    await p.aclose()


def failures(results) -> list[str]:
    return [f"{r.task}: {r.error}" for r in results if not r.ok]


async def test_a_few_generated_tasks_pass_tasks_check(tmp_path, provider):
    generate_tasks(tmp_path / "set", ["count-words", "tar-extract", "follow-pointer"], 1, seed=1)
    dirs = sorted(p for p in (tmp_path / "set").iterdir() if p.is_dir())
    results = await check_tasks(provider, dirs, jobs=2)
    assert len(results) == 3 and not failures(results)
    assert all(r.reward == 1.0 and r.empty_reward == 0.0 for r in results)


@pytest.mark.slow
async def test_one_instance_of_every_family_passes_tasks_check(tmp_path, provider):
    generate_tasks(tmp_path / "set", None, 1, seed=0)
    dirs = sorted(p for p in (tmp_path / "set").iterdir() if p.is_dir())
    results = await check_tasks(provider, dirs, jobs=2)
    assert len(results) == len(all_families()) and not failures(results)


@pytest.mark.slow
async def test_one_task_of_each_split_of_the_split_set_passes_tasks_check(tmp_path, provider):
    generate_split_set(tmp_path / "s", instances=1, seed=0)
    splits = load_splits(tmp_path / "s")
    dirs = [tmp_path / "s" / ids[0] for ids in (splits["train"], splits["eval"], splits["eval_instances"])]
    assert not failures(await check_tasks(provider, dirs))


# Each near miss rewrites the oracle's command into what a small model tends to type instead.
NEAR_MISSES = {
    "count-lines": lambda cmd: cmd.replace("wc -l < ", "wc -l "),  # prints the file name too
    "move-file": lambda cmd: cmd.replace("mv ", "cp "),  # the original stays
    "tar-create": lambda cmd: re.sub(r"-C /app (\w+)$", r"/app/\1", cmd),  # extracts to app/<dir>
    "delete-by-extension": lambda cmd: re.sub(r"\*\.\w+$", "*", cmd),  # deletes everything
    "set-mode": lambda cmd: re.sub(r"chmod \d+", "chmod 777", cmd),
    "most-common": lambda cmd: cmd.replace(" | awk '{print $2}'", ""),  # "  5 word"
    "csv-column": lambda cmd: cmd.replace("tail -n +2 ", "cat "),  # keeps the header line
    # A link planted at the output path (to a file with the right text) is not the file asked for.
    "write-line": lambda cmd: cmd.replace(" > ", " > /tmp/planted && ln -s /tmp/planted "),
}


@pytest.mark.parametrize("family", sorted(NEAR_MISSES))
async def test_near_misses_score_zero(tmp_path, provider, family):
    (inst,) = draw_instances(families_named([family]), 1, seed=2)
    write_set(tmp_path / "set", [inst], {"test": family})
    task = load_task(tmp_path / "set" / inst.task_id)
    oracle = inst.task.solution[-1]
    wrong = NEAR_MISSES[family](oracle)
    assert wrong != oracle
    for command, want in ((oracle, 1.0), (wrong, 0.0)):
        box = await provider.create(task.sandbox_spec())
        try:
            run = await box.exec(command, cwd=task.workdir, timeout_s=20)
            assert run.exit_code == 0, (command, run.output)
            verdict = await score_task(box, task)
        finally:
            await box.close()
        assert (verdict.status, verdict.reward) == (SCORED, want), (command, verdict.detail)
