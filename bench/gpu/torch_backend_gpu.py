"""GPU check of the torch trainer backend: the same GRPO step on CPU (chunked torch log-probs) and
on CUDA (the fused Triton log-prob kernel) must give the same loss and updated weights, and the
learnability bandit must learn on the GPU. Writes JSON to --out."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from agentrl.agent.trajectory import Trajectory
    from agentrl.config.schema import AlgorithmConfig, TrainConfig
    from agentrl.models.tiny import build_tiny_model
    from agentrl.train.torch_backend import TorchBackend

    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(8):
        ids = torch.randint(7, 1000, (40,), generator=g).tolist()
        trajs.append(Trajectory(episode_id=f"e{i}", task_id="t", group_id=f"g{i // 4}", prompt_len=20, token_ids=ids,
                                loss_mask=[0] * 20 + [1] * 20, rollout_logprobs=[0.0] * 20 + [-7.0] * 20,
                                weight_versions=[-1] * 20 + [0] * 20, outcome="scored", reward=float(i % 2)))
    out = {"machine": torch.cuda.get_device_name(), "torch": torch.__version__}
    results = {}
    for dev in ("cpu", "cuda"):
        train = TrainConfig(logprob_chunk_tokens=256)
        train.optimizer.lr = 1e-3
        model = build_tiny_model(0).to(dev)
        b = TorchBackend(model, train, AlgorithmConfig(group_size=4))
        t0 = time.perf_counter()
        m = b.train_step(trajs, [t.group_id for t in trajs])
        results[dev] = (m, {k: v.detach().float().cpu() for k, v in b.model.state_dict().items()},
                        time.perf_counter() - t0)
    (mc, wc, tc), (mg, wg, tg) = results["cpu"], results["cuda"]
    out["loss_cpu"], out["loss_cuda"] = mc["loss"], mg["loss"]
    out["loss_rel_diff"] = abs(mc["loss"] - mg["loss"]) / max(abs(mc["loss"]), 1e-12)
    out["max_abs_weight_diff_after_step"] = max(float((wc[k] - wg[k]).abs().max()) for k in wc)
    out["step_s_cpu"], out["step_s_cuda"] = tc, tg
    import test_learnability as L  # the same bandit as the CPU learnability test

    model = build_tiny_model(0).cuda()
    train = TrainConfig(logprob_chunk_tokens=256)
    train.optimizer.lr, train.optimizer.weight_decay = 2e-2, 0.0
    algo = AlgorithmConfig(group_size=16, prompts_per_step=2)
    b = TorchBackend(model, train, algo)
    prompts = [torch.randint(1, 1000, (6,), generator=g).tolist() for _ in range(4)]
    curve = []
    for step in range(25):
        batch, gids = [], []
        for pi in range(2):
            prompt = prompts[(step * 2 + pi) % 4]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt], device="cuda")).logits[0, -1].float()
            logp = torch.log_softmax(logits, -1)
            for k, tok in enumerate(torch.multinomial(logp.exp(), 16, replacement=True).tolist()):
                gid = f"s{step}p{pi}"
                batch.append(Trajectory(episode_id=f"{gid}e{k}", task_id="x", group_id=gid, prompt_len=6,
                                        token_ids=prompt + [tok], loss_mask=[0] * 6 + [1],
                                        rollout_logprobs=[0.0] * 6 + [float(logp[tok])],
                                        weight_versions=[-1] * 6 + [b.version], outcome="scored",
                                        reward=float(L.rewarded(tok))))
                gids.append(gid)
        curve.append(b.train_step(batch, gids)["reward_mean"])
    out["bandit_reward_curve_cuda"] = curve
    out["bandit_learned"] = sum(curve[-5:]) / 5 >= 0.9
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0 if out["loss_rel_diff"] < 1e-2 and out["bandit_learned"] else 1


if __name__ == "__main__":
    sys.exit(main())
