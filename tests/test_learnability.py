"""A learnability check that can fail: GRPO on the tiny GLM must learn a one-token bandit
(reward 1 when the sampled token is one of 10% of the vocabulary) from chance (~0.1) to >= 0.9,
and its sign-flipped twin must not learn. With partial rollout every completion is a generation
interrupted by weight updates: its first token was sampled by the weights of PARTIAL_LAG versions
ago, the rewarded last token by the current ones, and the batch goes through the buffer's
stale-token policy (mask: the first token leaves the loss; tis: it stays, TIS-weighted)."""

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


PARTIAL_LAG = 2  # versions between a continued completion's first token and its last
PARTIAL_MAX_STALENESS = 1  # so the first token is stale: masked or TIS-corrected


def sample_continued(stale, model, prompt, n):
    """n two-token completions: the first token from `stale`, the second from `model` after it."""
    first = sample_group(stale, prompt, n, version=None)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + [a] for a, _ in first])).logits[:, -1].float()
    logp = torch.log_softmax(logits, -1)
    second = torch.multinomial(logp.exp(), 1).squeeze(1).tolist()
    return [(a, lpa, b, float(logp[i, b])) for i, ((a, lpa), b) in enumerate(zip(first, second))]


def run_grpo(sign: float, steps: int, seed: int = 0, partial: str | None = None):
    import copy

    from agentrl.buffer.batch_view import batch_view

    torch.manual_seed(seed)
    model = make_tiny(seed)
    train = TrainConfig(micro_batch_tokens=4096, logprob_chunk_tokens=256)
    train.optimizer.lr = 2e-2
    train.optimizer.weight_decay = 0.0
    algo = AlgorithmConfig(group_size=16, prompts_per_step=2)
    backend = TorchBackend(model, train, algo)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 1000, (6,), generator=g).tolist() for _ in range(4)]
    history, snapshots = [], {0: copy.deepcopy(model)}
    for step in range(steps):
        v = backend.version
        trajs, gids = [], []
        for p_i in range(algo.prompts_per_step):
            prompt = prompts[(step * algo.prompts_per_step + p_i) % len(prompts)]
            gid = f"s{step}p{p_i}"
            if partial is None:
                completions = [([tok], [lp], [v]) for tok, lp in sample_group(model, prompt, algo.group_size, v)]
            else:
                old = max(v - PARTIAL_LAG, 0)
                completions = [([a, b], [lpa, lpb], [old, v])
                               for a, lpa, b, lpb in sample_continued(snapshots[old], model, prompt, algo.group_size)]
            for k, (toks, lps, versions) in enumerate(completions):
                trajs.append(Trajectory(
                    episode_id=f"{gid}e{k}", task_id=str(p_i), group_id=gid, prompt_len=len(prompt),
                    token_ids=prompt + toks, loss_mask=[0] * len(prompt) + [1] * len(toks),
                    rollout_logprobs=[0.0] * len(prompt) + lps, weight_versions=[-1] * len(prompt) + versions,
                    outcome=SCORED, reward=sign * (1.0 if rewarded(toks[-1]) else 0.0)))
                gids.append(gid)
        if partial is not None:  # what the replay buffer hands the trainer under partial rollout
            trajs, facts = batch_view(trajs, v, PARTIAL_MAX_STALENESS, partial)
            assert facts["stale_tokens"] == (len(trajs) if v >= PARTIAL_LAG else 0)
        backend.train_step(trajs, gids)
        # The pass rate, whatever the sign: the negative control (sign -1) negates the reward the
        # trainer sees, which negates every group advantage, so it must unlearn the rewarded tokens.
        history.append(sum(rewarded(t.token_ids[-1]) for t in trajs) / len(trajs))
        snapshots[backend.version] = copy.deepcopy(model)
        snapshots.pop(backend.version - PARTIAL_LAG - 1, None)
    return history


@pytest.mark.slow
@pytest.mark.parametrize("partial", [None, "mask", "tis"])
def test_grpo_learns_and_sign_flip_does_not(partial):
    up = run_grpo(+1.0, steps=25, partial=partial)
    down = run_grpo(-1.0, steps=25, partial=partial)
    start = sum(up[:3]) / 3
    assert start < 0.4, f"the bandit should start near chance, got {start}"
    end_up = sum(up[-5:]) / 5
    end_down = sum(down[-5:]) / 5
    assert end_up >= 0.9, f"GRPO did not learn: last rewards {up[-5:]}"
    assert end_down <= 0.2, f"sign-flipped GRPO learned anyway: last rewards {down[-5:]}"
