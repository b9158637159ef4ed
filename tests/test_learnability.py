"""A learnability check that can fail: GRPO on the tiny GLM must learn a one-token bandit
(reward 1 when the sampled token is one of 10% of the vocabulary) from chance (~0.1) to >= 0.9,
and its sign-flipped twin must not learn."""

import pytest
import torch

from agentrl.agent.trajectory import SCORED, Trajectory
from agentrl.config.schema import AlgorithmConfig, TrainConfig
from agentrl.train.torch_backend import TorchBackend


def make_tiny(seed=0):
    from transformers import GlmMoeDsaForCausalLM

    from agentrl.models.hf_config import hf_config_for

    torch.manual_seed(seed)
    return GlmMoeDsaForCausalLM(hf_config_for("tiny")).float()


def rewarded(token: int) -> bool:
    return token % 10 == 0


def sample_group(model, prompt, n, version, temperature=1.0):
    """n one-token completions of `prompt` with their exact logprobs."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    toks = torch.multinomial(logp.exp(), n, replacement=True).tolist()
    return [(t, float(logp[t])) for t in toks]


def run_grpo(sign: float, steps: int, seed: int = 0):
    torch.manual_seed(seed)
    model = make_tiny(seed)
    train = TrainConfig(micro_batch_tokens=4096, logprob_chunk_tokens=256)
    train.optimizer.lr = 2e-2
    train.optimizer.weight_decay = 0.0
    algo = AlgorithmConfig(group_size=16, prompts_per_step=2)
    backend = TorchBackend(model, train, algo, advantage_sign=sign)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 1000, (6,), generator=g).tolist() for _ in range(4)]
    history = []
    for step in range(steps):
        trajs, gids = [], []
        for p_i in range(algo.prompts_per_step):
            prompt = prompts[(step * algo.prompts_per_step + p_i) % len(prompts)]
            for k, (tok, lp) in enumerate(sample_group(model, prompt, algo.group_size, backend.version)):
                gid = f"s{step}p{p_i}"
                trajs.append(Trajectory(
                    episode_id=f"{gid}e{k}", task_id=str(p_i), group_id=gid, prompt_len=len(prompt),
                    token_ids=prompt + [tok], loss_mask=[0] * len(prompt) + [1],
                    rollout_logprobs=[0.0] * len(prompt) + [lp], weight_versions=[-1] * len(prompt) + [backend.version],
                    outcome=SCORED, reward=1.0 if rewarded(tok) else 0.0))
                gids.append(gid)
        m = backend.train_step(trajs, gids)
        history.append(m["reward_mean"])
    return history


@pytest.mark.slow
def test_grpo_learns_and_sign_flip_does_not():
    up = run_grpo(+1.0, steps=25)
    down = run_grpo(-1.0, steps=25)
    start = sum(up[:3]) / 3
    assert start < 0.4, f"the bandit should start near chance, got {start}"
    end_up = sum(up[-5:]) / 5
    end_down = sum(down[-5:]) / 5
    assert end_up >= 0.9, f"GRPO did not learn: last rewards {up[-5:]}"
    assert end_down <= 0.2, f"sign-flipped GRPO learned anyway: last rewards {down[-5:]}"
