"""Draw instances of task families from a seed and write them as a folder of tasks.

Instance i of family f under seed s is drawn from a Random seeded by sha256("f|s|i|attempt"),
so it depends on nothing else: the same (families, instances, seed) always writes the same
bytes, and the first k instances of a family are the same whatever the instance count. An
instance whose content (`render.fingerprint`) was already drawn, or is excluded, is redrawn
with the next attempt number.

A written set holds one folder per task plus `manifest.json` (the request, the generator's
source digest, each task's family, kind and fingerprint); a split set also holds `SPLITS.json`
({"train", "eval" = held-out families, "eval_instances" = held-out instances}), which the tbench2
env hands to the run loop as its splits.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from envs.tbench2.generate.family import Draw, Family, Task
from envs.tbench2.generate.registry import all_families, families_named
from envs.tbench2.generate.render import fingerprint, write_task
from envs.tbench2.generate.splits import HeldOutSplits, load_heldout_splits

# Redraws per instance before giving up: a family whose parameter space is nearly exhausted by
# the request (or by the exclusions) fails loudly instead of looping.
MAX_REDRAWS = 64
MANIFEST = "manifest.json"
PACKAGE_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Instance:
    task_id: str
    family: Family
    task: Task
    fingerprint: str


def generator_digest() -> str:
    """sha256 of this package's source and SPLITS.json: a changed generator is a new task set."""
    h = hashlib.sha256()
    for p in sorted([*PACKAGE_DIR.glob("*.py"), PACKAGE_DIR / "SPLITS.json"]):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def instance_rng(family: str, seed: int, index: int, attempt: int) -> random.Random:
    digest = hashlib.sha256(f"{family}|{seed}|{index}|{attempt}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def draw_instances(
    families: Sequence[Family], instances: int, seed: int, exclude: Iterable[str] = ()
) -> list[Instance]:
    """`instances` distinct instances of each family (ids `<family>-s<seed>-<i>`), none of whose
    fingerprints is in `exclude`."""
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    excluded = set(exclude)
    out = []
    for fam in families:
        seen = set(excluded)
        for i in range(instances):
            for attempt in range(MAX_REDRAWS):
                task = fam.make(Draw(instance_rng(fam.name, seed, i, attempt)))
                fp = fingerprint(fam, task)
                if fp not in seen:
                    break
            else:
                raise ValueError(f"task family {fam.name}: no new instance {i} (seed {seed}) after {MAX_REDRAWS} "
                                 "draws; ask for fewer instances")
            seen.add(fp)
            out.append(Instance(f"{fam.name}-s{seed}-{i:03d}", fam, task, fp))
    return out


def write_set(out: Path, instances: Sequence[Instance], request: dict,
              splits: dict[str, list[str]] | None = None) -> dict:
    """Write the task folders, manifest.json and (if given) SPLITS.json into `out`, which must be
    new or empty. Returns the manifest."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder: generate into a new folder")
    out.mkdir(parents=True, exist_ok=True)
    for inst in instances:
        write_task(out / inst.task_id, inst.task_id, inst.family, inst.task)
    manifest = {
        "generator": generator_digest(),
        "request": request,
        "tasks": {i.task_id: {"family": i.family.name, "kind": i.family.kind, "fingerprint": i.fingerprint}
                  for i in instances},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    if splits is not None:
        body = {"_comment": "Generated (envs/tbench2/generate): eval = held-out families (never trained), "
                "eval_instances = unseen instances of the training families.", **splits}
        (out / "SPLITS.json").write_text(json.dumps(body, indent=1) + "\n")
    return manifest


def generate_tasks(out: Path, families: Sequence[str] | None, instances: int, seed: int) -> dict:
    """`instances` tasks of each named family (all families when None) into `out`."""
    fams = families_named(families) if families else list(all_families().values())
    request = {"families": [f.name for f in fams], "instances": instances, "seed": seed}
    return write_set(out, draw_instances(fams, instances, seed), request)


def split_instances(instances: int, seed: int, splits: HeldOutSplits | None = None) -> dict[str, list[Instance]]:
    """The three sets of the repo's held-out splits: `train` (`instances` per training family from
    `seed`, never repeating a held-out instance's content), `eval` (held-out families) and
    `eval_instances` (held-out instances of the training families)."""
    s = splits or load_heldout_splits()
    if seed in s.heldout_seeds:
        raise ValueError(f"seed {seed} is one of the held-out seeds {s.heldout_seeds} (SPLITS.json); "
                         "train with another seed")
    train_fams, heldout_fams = families_named(s.train_families), families_named(s.heldout_families)
    heldout_inst = draw_instances(train_fams, s.heldout_instances, s.heldout_instance_seed)
    return {
        "train": draw_instances(train_fams, instances, seed, exclude=[i.fingerprint for i in heldout_inst]),
        "eval": draw_instances(heldout_fams, s.heldout_instances, s.heldout_family_seed),
        "eval_instances": heldout_inst,
    }


def generate_split_set(out: Path, instances: int, seed: int) -> dict:
    """The repo's held-out splits as one folder of tasks with SPLITS.json (see split_instances)."""
    sets = split_instances(instances, seed)
    request = {"families": "splits", "instances": instances, "seed": seed}
    every = [i for name in ("train", "eval", "eval_instances") for i in sets[name]]
    return write_set(out, every, request, {k: [i.task_id for i in v] for k, v in sets.items()})
