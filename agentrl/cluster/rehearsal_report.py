"""Printing a rehearsal report: tables for people, one JSON object for machines, and the
launcher's entry point."""

from __future__ import annotations

import contextlib
import json
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Any


def _ranges(xs: list[int]) -> str:
    xs = sorted(xs)
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def format_report(rep: dict[str, Any]) -> str:
    p, c = rep["plan"], rep["cluster"]
    par = p["parallel"]
    lines = [
        (f"rehearsal: {p['model']} on {p['num_nodes']} nodes x {p['gpus_per_node']} GPUs "
         f"({p['train_nodes']} train, {p['inference_nodes']} inference): PASSED"),
        (f"  trainer {p['train_gpus']} ranks, order {p['rank_order']}: TP{par['tp']} CP{par['cp']} DP{par['dp']} "
         f"PP{par['pp']} | experts EP{par['ep']} ETP{par['etp']} EDP{par['edp']}"),
        (f"  simulated with {len(c['raylets'])} raylet(s) + head, {c['nodes_per_raylet']} node(s) per raylet; "
         f"GPU participants probed as {c['probe']}"),
        "",
        f"{'node':>4}  {'role':<9}  placed",
    ]
    by_node: dict[int, list[dict]] = defaultdict(list)
    for h in rep["placements"]:
        if isinstance(h.get("node"), int):
            by_node[h["node"]].append(h)
    for node in sorted(by_node):
        hs = by_node[node]
        parts = []
        ranks = [h for h in hs if h["kind"] == "trainer"]
        if ranks:
            tps = sorted({(h["coords"]["pp"], h["coords"]["cp"], h["coords"]["dp"]) for h in ranks})
            parts.append(f"trainer ranks {_ranges([h['rank'] for h in ranks])} on GPUs "
                         f"{_ranges([g for h in ranks for g in h['gpu_ids']])} (pp,cp,dp) {tps}")
        for h in hs:
            if h["kind"] != "trainer":
                parts.append(f"{h['name']} on GPUs {_ranges(h['gpu_ids'])}")
        lines.append(f"{node:>4}  {hs[0]['role']:<9}  " + "; ".join(parts))
    lines.append("head  cpu        " + ", ".join(h["name"] for h in rep["placements"] if h.get("raylet") == "head"))
    w = rep["weights"]
    lines += ["", (f"weight update: {w['tensors']} HF tensors, {w['bytes'] / 2**30:.1f} GiB, buckets of "
                   f"{w['bucket_bytes'] >> 20} MiB")]
    per_stage: dict[int, list[dict]] = defaultdict(list)
    for b in w["buckets"]:
        per_stage[b["stage"]].append(b)
    for g in w["update_groups"]:
        bs = per_stage[g["stage"]]
        sources = sorted({r for b in bs for r in b["sources"]})
        lines.append(f"  {g['name']}: trainer rank {g['sender']} (gathering from ranks {_ranges(sources)}) -> "
                     f"{g['world_size'] - 1} engine ranks; {len(bs)} buckets, "
                     f"{sum(b['bytes'] for b in bs) / 2**30:.1f} GiB, {bs[0]['first']} .. {bs[-1]['last']}")
    t = rep["timings"]
    lines += ["", "start-up  " + ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in t["startup"].items()),
              "shutdown  " + ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in t["shutdown"].items()),
              "", "checks: " + "; ".join(rep["checks"])]
    lines += [f"note: {n}" for n in rep.get("notes", [])]
    return "\n".join(lines)


def run_for_launcher(cfg, plan, episode_workers: int, as_json: bool, echo: Callable[[str], None]) -> int:
    """`train --rehearse`: 0 when the rehearsal passes, 1 with the reason on failure."""
    from agentrl.cluster.rehearsal import RehearsalError, rehearse
    from agentrl.cluster.rehearsal_ranks import RankLayoutError
    from agentrl.cluster.rehearsal_weights import WeightScheduleError

    try:
        # Ray's driver prints raylet notices (e.g. "N PYTHON worker processes have been started") to
        # stdout from a thread; they go to stderr so that stdout carries only the report.
        with contextlib.redirect_stdout(sys.stderr):
            rep = rehearse(plan, cfg=cfg, episode_workers=episode_workers)
    except (RehearsalError, RankLayoutError, WeightScheduleError) as e:
        echo(f"rehearsal FAILED: {e}")
        return 1
    echo(json.dumps(rep, indent=1) if as_json else format_report(rep))
    return 0
