"""RNG state of a trainer process as plain tensors, lists and numbers, so that a checkpoint holding it
loads with `torch.load(weights_only=True)` (no pickled objects: a checkpoint file cannot run code)."""

from __future__ import annotations

import random

import numpy as np
import torch


def capture() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, inner, gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "python": {"version": int(version), "state": list(inner), "gauss": gauss}}


def restore(state: dict) -> None:
    torch.set_rng_state(state["torch"].cpu())
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
