"""Pass-rate curriculum: each new group's task is drawn by the difficulty band of its pass rate.

A TaskSampler (agentrl/policy/sampling.py): `next_task()`, `observe(task_id, rewards)`,
`state_dict()` / `load_state_dict()`, seeded. From prime-rl's DifficultyPoolSampler (its source,
read for facts: a task's score is the mean reward of its latest group; pools hard <= 0.25,
normal <= 0.75, easy <= 1.0 with per-task weights 0.2 / 1.0 / 0.2; unseen tasks weigh 1.0; the
RNG state and scores are checkpointed). What differs here, and why:
- a task's pass rate is an EMA of its groups' mean rewards (`ema` 1.0 is prime-rl's rule); one
  group of 8 is a noisy estimate, and async groups of one task finish out of order;
- the mix is per band, not per task: a band's share of new groups does not grow with its size.
  With ~270 generated tasks of which a small model fails most, per-task weights would spend most
  groups on the hard band, where groups are all-fail and carry no gradient;
- tasks not tried yet count as normal (explored at the normal share), and an empty band's share
  goes to the others in proportion.
Within a band the task is drawn uniformly. Rewards are assumed in [0, 1] (pass = 1).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

BANDS = ("hard", "normal", "easy")
DEFAULT_EMA = 0.5
DEFAULT_HARD_BELOW = 0.25
DEFAULT_EASY_ABOVE = 0.75
DEFAULT_WEIGHTS = {"hard": 0.2, "normal": 0.7, "easy": 0.1}


class PassRateCurriculum:
    def __init__(self, tasks: Sequence[str], seed: int = 0, *, ema: float = DEFAULT_EMA,
                 hard_below: float = DEFAULT_HARD_BELOW, easy_above: float = DEFAULT_EASY_ABOVE,
                 weights: dict[str, float] | None = None):
        if not tasks:
            raise ValueError("no training task to sample from")
        if not 0 < ema <= 1:
            raise ValueError(f"env.curriculum.ema must be in (0, 1], got {ema}")
        if not 0 <= hard_below < easy_above <= 1:
            raise ValueError(f"env.curriculum: need 0 <= hard_below ({hard_below}) < easy_above ({easy_above}) <= 1")
        self.weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        if set(self.weights) != set(BANDS) or min(self.weights.values()) < 0 or sum(self.weights.values()) <= 0:
            raise ValueError(f"env.curriculum weights must be >= 0 for {BANDS}, not all 0: got {self.weights}")
        self.tasks = list(dict.fromkeys(tasks))
        self._known = set(self.tasks)
        self.ema, self.hard_below, self.easy_above = ema, hard_below, easy_above
        self.rates: dict[str, float] = {}  # task -> EMA of its groups' mean rewards
        self.groups: dict[str, int] = {}  # task -> groups observed
        self.drawn = {b: 0 for b in BANDS}
        self.rng = random.Random(seed)

    @classmethod
    def from_config(cls, tasks: Sequence[str], cfg, seed: int = 0) -> PassRateCurriculum:
        """From env.curriculum (CurriculumConfig)."""
        return cls(tasks, seed, ema=cfg.ema, hard_below=cfg.hard_below, easy_above=cfg.easy_above,
                   weights={"hard": cfg.hard_weight, "normal": cfg.normal_weight, "easy": cfg.easy_weight})

    # -- bands ----------------------------------------------------------------------------------
    def pass_rate(self, task_id: str) -> float | None:
        return self.rates.get(task_id)

    def band(self, task_id: str) -> str:
        rate = self.rates.get(task_id)
        if rate is None:
            return "normal"
        return "hard" if rate < self.hard_below else "easy" if rate > self.easy_above else "normal"

    def bands(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {b: [] for b in BANDS}
        for t in self.tasks:
            out[self.band(t)].append(t)
        return out

    # -- the sampler protocol -------------------------------------------------------------------
    def next_task(self) -> str:
        pools = self.bands()
        live = [b for b in BANDS if pools[b] and self.weights[b] > 0]
        if not live:  # every task is in bands weighted 0: fall back to every task
            return self.rng.choice(self.tasks)
        band = self.rng.choices(live, weights=[self.weights[b] for b in live])[0]
        self.drawn[band] += 1
        return self.rng.choice(pools[band])

    def observe(self, task_id: str, rewards: Sequence[float | None]) -> None:
        """A finished group of `task_id`; missing rewards (infra errors) are left out."""
        if task_id not in self._known:
            raise KeyError(f"curriculum: {task_id!r} is not a training task")
        scored = [float(r) for r in rewards if r is not None]
        if not scored:
            return
        mean = sum(scored) / len(scored)
        old = self.rates.get(task_id)
        self.rates[task_id] = mean if old is None else (1 - self.ema) * old + self.ema * mean
        self.groups[task_id] = self.groups.get(task_id, 0) + 1

    def metrics(self) -> dict[str, float]:
        pools = self.bands()
        seen = [self.rates[t] for t in self.tasks if t in self.rates]
        out = {f"curriculum_{b}_tasks": float(len(pools[b])) for b in BANDS}
        out["curriculum_unseen_tasks"] = float(len(self.tasks) - len(seen))
        out["curriculum_mean_pass_rate"] = sum(seen) / len(seen) if seen else 0.0
        out.update({f"curriculum_drawn_{b}": float(n) for b, n in self.drawn.items()})
        return out

    def state_dict(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {"kind": "pass_rate", "rates": dict(self.rates), "groups": dict(self.groups),
                "drawn": dict(self.drawn), "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict) -> None:
        """Restore rates of the tasks still in the set (a resumed run may train on another set);
        another sampler's state is ignored, as RoundRobinSampler does."""
        if state.get("kind") != "pass_rate":
            return
        self.rates = {t: float(r) for t, r in state["rates"].items() if t in self._known}
        self.groups = {t: int(n) for t, n in state.get("groups", {}).items() if t in self._known}
        self.drawn.update({b: int(n) for b, n in state.get("drawn", {}).items() if b in self.drawn})
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
