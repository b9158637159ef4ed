"""Bad input: a malformed task.toml, malformed model output, an oversized prompt, a bad config
value, a checkpoint of the wrong architecture. Each must end in a clear error naming the field or
file (or, for model output, in a normal episode that says what was wrong), never in a crash."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from bench.faults_base import Checks, Outcome, Scenario

ROOT = Path(__file__).resolve().parents[1]


def malformed_task_toml(tmp: Path) -> Outcome:
    from envs.tbench2.env import TB2Env
    from envs.tbench2.loader import DEFAULT_TASKS_DIR, TaskFormatError, load_task

    c = Checks()
    tasks = tmp / "tasks"
    shutil.copytree(DEFAULT_TASKS_DIR / "malformed-toml", tasks / "malformed-toml")
    shutil.copytree(DEFAULT_TASKS_DIR / "create-greeting", tasks / "create-greeting")
    broken = tasks / "broken-syntax"
    shutil.copytree(DEFAULT_TASKS_DIR / "create-greeting", broken)
    (broken / "task.toml").write_text('[verifier\ntimeout_sec = 10\n')
    for d, needle in ((tasks / "malformed-toml", "[verifier].timeout_sec"), (broken, "not valid TOML")):
        try:
            load_task(d)
            c(False, f"{d.name} is refused")
        except TaskFormatError as e:
            c(needle in str(e) and "task.toml" in str(e), f"{d.name}: TaskFormatError: {e}")
    env = TB2Env(tasks_dir=tasks)
    ids = env.task_ids()
    c(ids == ["create-greeting"] and set(env.invalid_tasks) == {"malformed-toml", "broken-syntax"},
      f"the env serves only the valid task {ids} and lists the invalid ones with their errors")
    r = subprocess.run([sys.executable, "-m", "agentrl.cli", "tasks", "check", str(tasks / "malformed-toml"),
                        "--json"], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    c("timeout_sec" in r.stdout + r.stderr, f"`agentrl tasks check` names the field (exit {r.returncode})")
    return c.outcome()


class Replies:
    """Stands in for the model only: replays malformed replies (what a badly trained policy says)."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tok, self.replies = tokenizer, list(replies)

    async def generate(self, input_ids, sampling, *, session_id, rid=None):
        from agentrl.rollout.types import GenerateResult

        text = self.replies.pop(0) if self.replies else "TASK_COMPLETE"
        ids = self.tok.encode(text, add_special_tokens=False)[: sampling.max_new_tokens]
        return GenerateResult(ids, [-0.2] * len(ids), [0] * len(ids), "length" if len(ids) else "stop")


MALFORMED = ["```bash\necho unterminated block", "", "\x00\x01\ufffd binary junk ```", "```python\nprint(1)\n```",
             '{"keystrokes": "ls", "analysis": ', "<think>never closed"]


async def malformed_model_output(tmp: Path) -> Outcome:
    from agentrl.agent.episode import run_episode
    from agentrl.config.schema import AgentConfig, SandboxConfig
    from agentrl.models.tokenizer import load_tokenizer
    from agentrl.rollout.types import SamplingParams
    from agentrl.sandbox.local import LocalSandboxProvider
    from envs.tbench2.env import TB2Env

    c = Checks()
    tok = load_tokenizer("tiny")
    p = LocalSandboxProvider(SandboxConfig(), run_id=f"flt{uuid.uuid4().hex[:6]}", root_dir=tmp / "boxes")
    try:
        for fmt in ("bash_block", "terminus_json"):
            traj = await run_episode(TB2Env(provider=p), Replies(tok, MALFORMED), tok, "create-greeting",
                                     AgentConfig(max_turns=len(MALFORMED), action_format=fmt),
                                     SamplingParams(max_new_tokens=48), f"gbad{fmt}-0", f"gbad{fmt}")
            n = traj.info["parse_errors"]
            c(traj.outcome == "scored" and traj.reward == 0.0,
              f"{fmt}: {len(MALFORMED)} malformed replies -> a normal episode, outcome {traj.outcome}, "
              f"reward {traj.reward}")
            c(n >= 4, f"{fmt}: {n} parse errors counted, each answered with a format hint to the model")
    finally:
        await p.aclose()
    return c.outcome()


async def oversized_prompt(tmp: Path) -> Outcome:
    from agentrl.agent.episode import run_episode
    from agentrl.config.schema import AgentConfig, SandboxConfig
    from agentrl.models.policy import load_policy
    from agentrl.rollout.client import EngineClient, EngineError
    from agentrl.rollout.embedded.server import EmbeddedEngineServer
    from agentrl.rollout.types import SamplingParams
    from agentrl.sandbox.local import LocalSandboxProvider
    from envs.tbench2.env import TB2Env

    c = Checks()
    model, tok = load_policy("tiny", seed=0)
    server = EmbeddedEngineServer(model, tok, model_path="tiny", max_batch_size=4)
    url = await server.start()
    try:
        async with EngineClient(url, timeout_s=60) as client:
            ctx = server.scheduler.context_len
            try:
                await client.generate([5] * (ctx + 10), SamplingParams(max_new_tokens=4), session_id="big")
                c(False, "the engine refuses a prompt longer than its context")
            except EngineError as e:
                c(e.status == 400 and "does not fit the context length" in str(e),
                  f"engine: {ctx + 10}-token prompt refused with HTTP {e.status}: {str(e)[-110:]}")
            r = await client.generate([5, 6, 7], SamplingParams(max_new_tokens=4), session_id="small")
            c(len(r.output_ids) >= 1, "the engine keeps serving normal prompts")
        p = LocalSandboxProvider(SandboxConfig(), run_id=f"flt{uuid.uuid4().hex[:6]}", root_dir=tmp / "boxes")
        try:
            async with EngineClient(url, timeout_s=60) as client:
                traj = await run_episode(TB2Env(provider=p), client, tok, "create-greeting",
                                         AgentConfig(max_turns=3, max_context_tokens=48),
                                         SamplingParams(max_new_tokens=16), "gbig-0", "gbig")
        finally:
            await p.aclose()
        error = traj.info.get("error", "")
        c(traj.outcome == "infra_error:task" and traj.num_generated == 0 and traj.reward is None
          and not traj.trainable and "agent.max_context_tokens=48" in error,
          f"agent: a task prompt of {traj.prompt_len} tokens over agent.max_context_tokens=48 ends the episode "
          f"'{traj.outcome}' (a data error, never trained) before any generation: {error[:120]}")
    finally:
        await server.stop()
    return c.outcome()


def bad_config_value(tmp: Path) -> Outcome:
    from agentrl.config.loader import ConfigError, load_config

    c = Checks()
    cases = [("train.lr=fast", "train.lr"), ("algorithm.group_size=0", "algorithm.group_size"),
             ("sandbox.backend=docker", "sandbox.backend"), ("rollout.max_new_tokenz=5", "max_new_tokenz")]
    for item, needle in cases:
        try:
            load_config("local", [item])
            c(False, f"--set {item} is refused")
        except (ConfigError, ValueError) as e:
            first = str(e).splitlines()[-1].strip()
            c(needle in str(e), f"--set {item}: {first[:140]}")
    r = subprocess.run([sys.executable, str(ROOT / "launchers" / "run_glm5_2_daytona.py"), "train",
                        "--model-name", "tiny", "--num-nodes", "1", "--set", "buffer.max_staleness=-3", "--dry-run"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    c(r.returncode == 2 and "buffer.max_staleness" in r.stderr and "Traceback" not in r.stderr,
      f"launcher: exit {r.returncode}, stderr names buffer.max_staleness, no traceback")
    return c.outcome()


def wrong_architecture_checkpoint(tmp: Path) -> Outcome:
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentrl.config.schema import AlgorithmConfig, TrainConfig
    from agentrl.models.checkpoint import CheckpointError, validate_glm_checkpoint
    from agentrl.models.policy import load_policy
    from agentrl.train.torch_backend import TorchBackend

    c = Checks()
    # 1. an HF folder of another architecture where a GLM-5.2 checkpoint is expected
    hf = tmp / "llama-folder"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    try:
        validate_glm_checkpoint(hf)
        c(False, "a llama folder is refused as a GLM-5.2 checkpoint")
    except CheckpointError as e:
        c("config.json" in str(e) and "model_type" in str(e), f"models validate: {str(e)[:160]}")
    # 2. a training checkpoint of another model in the run dir the trainer resumes from
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    TorchBackend(llama, TrainConfig(), AlgorithmConfig()).save_checkpoint(tmp / "ckpt", {"step": 3})
    glm, _ = load_policy("tiny", seed=0)
    before = {k: v.clone() for k, v in list(glm.state_dict().items())[:3]}
    backend = TorchBackend(glm, TrainConfig(), AlgorithmConfig())
    try:
        backend.load_checkpoint(tmp / "ckpt")
        c(False, "the trainer refuses a checkpoint of another architecture")
    except Exception as e:  # noqa: BLE001 - what kind of error it is, is what we report
        msg = str(e)
        c("state.pt" in msg and len(msg) < 1500 and "architecture" in msg,
          f"trainer resume: {type(e).__name__}: {msg[:220]}")
    after = dict(list(glm.state_dict().items())[:3])
    c(all(torch.equal(before[k], after[k]) for k in before) and backend.version == 0,
      "the model was left untouched (no partial load), version still 0")
    return c.outcome()


SCENARIOS = (
    Scenario("input_malformed_task_toml", "input",
             "a task.toml with a wrong type or broken syntax is refused with TaskFormatError naming task.toml and "
             "the field; the env serves the valid tasks and lists the invalid ones", malformed_task_toml),
    Scenario("input_malformed_model_output", "input",
             "unparseable replies (unterminated block, empty, binary, wrong language, broken JSON) are parse "
             "errors fed back to the model; the episode ends normally, scored 0, never an infra error",
             malformed_model_output),
    Scenario("input_oversized_prompt", "input",
             "the engine refuses a prompt over its context length with HTTP 400 naming both lengths and keeps "
             "serving; a task whose first prompt fills agent.max_context_tokens is a data error "
             "(infra_error:task, never trained) before the engine is asked",
             oversized_prompt),
    Scenario("input_bad_config_value", "input",
             "a bad --set value or unknown key is refused naming the key; the launcher exits 2 without a "
             "traceback", bad_config_value),
    Scenario("input_wrong_architecture_checkpoint", "input",
             "a checkpoint of another architecture is refused naming the file (config.json / state.pt) and the "
             "mismatch; the model is left untouched", wrong_architecture_checkpoint),
)
