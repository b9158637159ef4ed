"""The held-out splits of the generated tasks, fixed in the repo (SPLITS.json next to this file).

- by family: `heldout_families` are never trained on; each has a sibling skill among the
  training families (count-words / count-lines, tail-lines / head-lines, ...), so that transfer
  is possible and measurable;
- by instance: unseen instances of the training families, drawn with `heldout_instance_seed`;
  a training set never holds an instance with the same content (build.generate_split_set
  excludes their fingerprints and redraws).
Every family is in exactly one of the two family lists, so a new family must be placed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SPLITS_PATH = Path(__file__).resolve().with_name("SPLITS.json")


@dataclass(frozen=True)
class HeldOutSplits:
    train_families: tuple[str, ...]
    heldout_families: tuple[str, ...]
    heldout_family_seed: int
    heldout_instance_seed: int
    heldout_instances: int  # instances per family in each held-out split

    @property
    def heldout_seeds(self) -> tuple[int, int]:
        return (self.heldout_family_seed, self.heldout_instance_seed)


def load_heldout_splits(path: Path = SPLITS_PATH) -> HeldOutSplits:
    from envs.tbench2.generate.registry import all_families

    raw = json.loads(Path(path).read_text())
    fields = ("train_families", "heldout_families", "heldout_family_seed", "heldout_instance_seed",
              "heldout_instances")
    missing = [f for f in fields if f not in raw]
    if missing:
        raise ValueError(f"{path}: missing {missing}")
    splits = HeldOutSplits(
        tuple(raw["train_families"]), tuple(raw["heldout_families"]), int(raw["heldout_family_seed"]),
        int(raw["heldout_instance_seed"]), int(raw["heldout_instances"]),
    )
    known = set(all_families())
    both = set(splits.train_families) & set(splits.heldout_families)
    if both:
        raise ValueError(f"{path}: families {sorted(both)} are in train_families and heldout_families")
    listed = set(splits.train_families) | set(splits.heldout_families)
    if listed != known:
        raise ValueError(f"{path}: unknown families {sorted(listed - known)}; "
                         f"families in neither list {sorted(known - listed)}")
    if splits.heldout_family_seed == splits.heldout_instance_seed or splits.heldout_instances < 1:
        raise ValueError(f"{path}: the two held-out seeds must differ and heldout_instances must be >= 1")
    return splits
