"""`agentrl eval --harness harbor`: Harbor's Terminus-2 plays the held-out tasks against an embedded
engine through its OpenAI API, in agentrl's sandbox, beside agentrl's own eval (slow)."""

from __future__ import annotations

import json
import shutil

import pytest

from agentrl.harbor.eval import terminus_kwargs

pytest.importorskip("harbor", reason="the optional harbor extra is not installed")

SETTINGS = ["agent.max_turns=2", "agent.max_context_tokens=4096", "rollout.max_new_tokens=32",
            "agent.episode_timeout_s=40", "rollout.temperature=0.7", "rollout.top_p=0.9"]


def config(tmp_path):
    from agentrl.config.front import resolve_run

    cfg, _ = resolve_run(config="local", overrides=[*SETTINGS, f"logging.run_dir={tmp_path}"], check_runnable=False)
    return cfg


def test_terminus_gets_the_runs_sampling_settings(tmp_path):
    kw = terminus_kwargs(config(tmp_path), "http://127.0.0.1:1/v1")
    assert (kw["temperature"], kw["max_turns"], kw["llm_call_kwargs"]) == (0.7, 2, {"max_tokens": 32, "top_p": 0.9})
    assert kw["model_info"] == {"max_input_tokens": 4096, "max_output_tokens": 32}
    assert kw["enable_summarize"] is False and kw["proactive_summarization_threshold"] == 0


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("tmux") is None, reason="needs bwrap and tmux")
async def test_terminus_2_through_harbor_beside_agentrls_eval(tmp_path):
    """The tiny model on the 5 held-out fixture tasks, one sample each (~3 min on 2 CPUs): both
    harnesses finish and score every task; Terminus-2 really talked to the engine."""
    from agentrl.harbor.eval import compare_harnesses

    cfg = config(tmp_path)
    tasks = ["write-name", "write-status", "make-dir-build", "copy-notes", "delete-tmp"]
    report = await compare_harnesses(cfg, tasks, 1, checkpoint=None, concurrency=2, work_dir=tmp_path / "eval")
    for harness in ("agentrl", "harbor"):
        r = report[harness]
        assert r["samples"] + r["infra_errors"] == 5 and r["infra_errors"] == 0, (harness, r["outcomes"])
        assert r["pass_rate"] is not None
    assert sorted(t["task_id"] for t in report["harbor"]["trials"]) == sorted(tasks)
    steps = [json.loads(p.read_text())["steps"] for p in (tmp_path / "eval" / "harbor").rglob("agent/trajectory.json")]
    assert len(steps) == 5 and any(s["source"] == "agent" for trial in steps for s in trial)
