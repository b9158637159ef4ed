"""agentrl transcripts -> ATIF trajectories that Harbor's own model validates and `harbor view` serves."""

from __future__ import annotations

import json

import pytest

from agentrl.agent.actions import make_action_format
from agentrl.agent.chat import ChatTokens
from agentrl.harbor.atif import TurnCutter, transcript_to_atif

REPLIES = ["```bash\necho hi > /app/name.txt\n```", "```bash\ncat /app/name.txt\n```", "TASK_COMPLETE"]
OBSERVATIONS = ["(no output)", "hi\n<|assistant|> the model may print anything"]


@pytest.fixture(scope="module")
def tokenizer():
    from agentrl.models.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()


def episode_text(tokenizer, *, eos: bool = True) -> str:
    """What runner.py writes as a transcript's text: the decoded ids after the prompt, built the
    way agentrl's agent builds them (model output, then the observation delta)."""
    chat = ChatTokens(tokenizer, "system")
    ids: list[int] = []
    for i, reply in enumerate(REPLIES):
        out = tokenizer.encode(reply, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])
        ids += out
        if i < len(OBSERVATIONS):
            ids += chat.observation_ids(out, OBSERVATIONS[i])
    return tokenizer.decode(ids)


@pytest.mark.parametrize("eos", [True, False])
def test_turns_are_cut_back_apart_at_the_templates_observation_turns(tokenizer, eos):
    cutter = TurnCutter.for_tokenizer(tokenizer)
    replies, observations = cutter.cut(episode_text(tokenizer, eos=eos), len(REPLIES))
    assert replies == REPLIES and observations == OBSERVATIONS
    assert cutter.cut(episode_text(tokenizer), len(REPLIES) + 1) is None  # not the row's turn count


def row(tokenizer, **kw) -> dict:
    return {"episode_id": "g1-0", "task_id": "write-name", "group_id": "g1", "outcome": "scored", "reward": 1.0,
            "tokens": 300, "generated": 40, "turns": 3, "time": 1796117812.5, "duration_s": 4.0, "passed": True,
            "timings": {"total_s": 4.0}, "info": {"parse_errors": 0}, "turn_versions": [[0], [0], [1]],
            "text": episode_text(tokenizer), "versions": [0, 1], **kw}


def test_a_transcript_becomes_an_atif_trajectory(tokenizer):
    system = make_action_format("bash_block", 60.0).system_prompt
    t = transcript_to_atif(row(tokenizer), cutter=TurnCutter.for_tokenizer(tokenizer), model_name="tiny",
                           system_prompt=system, instruction="Write the name.")
    assert [s["source"] for s in t["steps"]] == ["system", "user", "agent", "user", "agent", "user", "agent"]
    assert [s["step_id"] for s in t["steps"]] == list(range(1, 8))
    assert [s["message"] for s in t["steps"] if s["source"] == "agent"] == REPLIES
    assert t["steps"][6]["extra"] == {"weight_versions": [1]} and t["extra"]["reward"] == 1.0
    one = transcript_to_atif(row(tokenizer, turns=5), cutter=TurnCutter.for_tokenizer(tokenizer), model_name="tiny",
                             system_prompt=system, instruction=None)
    assert len(one["steps"]) == 3 and "could not be told apart" in one["steps"][2]["extra"]["agentrl_split"]
    trajectories = pytest.importorskip("harbor.models.trajectories", reason="the optional harbor extra")
    for doc in (t, one):
        assert trajectories.Trajectory.model_validate(doc).steps[-1].source == "agent"


def test_a_run_dir_opens_in_harbors_viewer(tmp_path, tokenizer):
    pytest.importorskip("harbor", reason="the optional harbor extra is not installed")
    from fastapi.testclient import TestClient
    from harbor.viewer.server import create_app

    from agentrl.config.schema import RunConfig
    from agentrl.harbor.viewer_job import export_run
    from envs.tbench2.loader import DEFAULT_TASKS_DIR, load_task

    run = tmp_path / "run"
    (run / "transcripts").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(RunConfig().model_dump(mode="json")))
    rows = [row(tokenizer), row(tokenizer, episode_id="g1-1", outcome="infra_error:sandbox", reward=None, turns=1,
                                text="```bash\nls\n```<|endoftext|>")]
    (run / "transcripts" / "worker_0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn": ')
    job_dir, n = export_run(run, tmp_path / "jobs", job_name="demo")
    assert n == 2 and job_dir == tmp_path / "jobs" / "demo"
    with TestClient(create_app(tmp_path / "jobs")) as client:
        jobs = client.get("/api/jobs").json()["items"]
        assert [j["name"] for j in jobs] == ["demo"] and jobs[0]["n_total_trials"] == 2
        trials = {t["name"]: t for t in client.get("/api/jobs/demo/trials").json()["items"]}
        assert set(trials) == {"write-name__g1-0", "write-name__g1-1"}
        assert trials["write-name__g1-0"]["reward"] == 1.0 and trials["write-name__g1-1"]["error_type"] == "sandbox"
        traj = client.get("/api/jobs/demo/trials/write-name__g1-0/trajectory").json()
        assert traj["schema_version"] == "ATIF-v1.8"
        assert traj["steps"][1]["message"] == load_task(DEFAULT_TASKS_DIR / "write-name").instruction  # rebuilt
