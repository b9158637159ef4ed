"""Generated task sets built on demand into a content-addressed cache.

`ensure_generated(families, instances, seed)` returns the folder of that set, building it once:
the folder is `<cache root>/<key>`, the key a hash of the request and of the generator's source
(build.generator_digest). What survives a resume: the run's config holds the request, not the
folder; the resumed run computes the same key and finds the folder, or, if the cache was wiped,
rebuilds the same bytes. A changed generator gets a new key (the old set stays where it was), so
a resume never mixes two versions of a task under one id. Concurrent callers (several episode
workers starting at once) each build into a private temporary folder and rename it into place;
the first rename wins and the others discard theirs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from envs.tbench2.generate.build import MANIFEST, generate_split_set, generate_tasks, generator_digest


def default_cache_root() -> Path:
    """$XDG_CACHE_HOME/agentrl/tasks, else ~/.cache/agentrl/tasks (read when called)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "agentrl" / "tasks"


def cache_key(families: list[str] | None, instances: int, seed: int) -> str:
    request = {"families": list(families) if families else "splits", "instances": instances, "seed": seed,
               "generator": generator_digest()}
    return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:16]


def ensure_generated(families: list[str] | None, instances: int, seed: int,
                     cache_dir: str | Path | None = None) -> Path:
    """The folder of the generated set, built if missing. `families` None: the repo's held-out
    splits (training families plus both held-out sets, with SPLITS.json); a list: just those
    families, all for training."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / cache_key(families, instances, seed)
    if (target / MANIFEST).is_file():
        return target
    if target.exists():
        raise FileExistsError(f"{target} exists but has no {MANIFEST} (not a generated set): remove it")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        if families:
            generate_tasks(tmp, families, instances, seed)
        else:
            generate_split_set(tmp, instances, seed)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / MANIFEST).is_file():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
