"""Merge `bench.kernels` reports into the record: `python -m bench.kernels_merge --into bench/results/kernels.json
PART.json ... --note TEXT`.

The GPU machine writes one report per call (a family or two: bench/gpu/h200_owed.sh); bench/results/kernels.json
holds one card's numbers, each kernel entry measured beside its own baseline in one run. A part's entry replaces the
record's entry of the same name and shape; entries new to the record are added; the part's tuner choices update the
record's. Refused, so that the record never mixes cards or keeps a wrong number: a part from another GPU model (keep it
in a file of its own, as kernels_fwd_h100.json), a part without a CUDA device. Entries that failed or were not correct
are not merged (the record's entry stays) and are listed. Each merge adds a line to the record's `runs`: the families,
the date, the machine, the versions and the note; a line goes when the part replaced every entry of every family it names.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any


class MergeError(ValueError):
    """A part that must not go into the record (the message says why and what to do)."""


def _gpu(report: dict, where: str) -> str:
    gpus = report.get("machine", {}).get("gpus") or []
    if not gpus:
        raise MergeError(f"{where}: no GPU in its machine.gpus: timings without a CUDA device are not kernel numbers")
    return gpus[0]["name"]


def _key(entry: dict) -> tuple[str, str]:
    return entry["name"], json.dumps(entry.get("shape"), sort_keys=True)


def merge(record: dict, part: dict, note: str, where: str = "part",
          date: str | None = None) -> tuple[dict, list[str]]:
    """record with part's good entries in place of (or beside) its own; returns (new record, lines to print)."""
    if "warning" in part:
        raise MergeError(f"{where}: {part['warning']}")
    have, got = _gpu(record, "the record"), _gpu(part, where)
    if have != got:
        raise MergeError(f"{where} ran on {got}, the record holds {have} numbers: keep it in a file of its own "
                         f"(as bench/results/kernels_fwd_h100.json)")
    out = json.loads(json.dumps(record))
    index = {_key(e): i for i, e in enumerate(out["kernels"]) if "name" in e}
    lines, families, merged = [], [], set()
    for entry in part.get("kernels", []):
        if "error" in entry or entry.get("correct") is False:
            lines.append(f"kept the record's {entry.get('name')}: the part's failed "
                         f"({entry.get('error') or 'not correct'})")
            continue
        key = _key(entry)
        merged.add(key)
        family = entry["name"]
        if family not in families:
            families.append(family)
        if key in index:
            old = out["kernels"][index[key]]
            lines.append(f"{family} {key[1]}: {old.get('ms')} -> {entry.get('ms')} ms")
            out["kernels"][index[key]] = entry
        else:
            lines.append(f"{family} {key[1]}: new, {entry.get('ms')} ms")
            index[key] = len(out["kernels"])
            out["kernels"].append(entry)
    if not families:
        raise MergeError(f"{where}: no entry to merge (every one failed or was not correct)")
    out.setdefault("tuning", {}).update(part.get("tuning", {}))
    machine = part["machine"]
    when = date or datetime.date.today().isoformat()
    replaced = {n for n in families if all(_key(e) in merged for e in record["kernels"] if e.get("name") == n)}
    runs = out.setdefault("runs", {})
    for names in [k for k in runs if set(k.split(", ")) <= replaced]:  # a run none of whose entries is left
        del runs[names]
    runs[", ".join(families)] = (
        f"{when} on {got} ({machine.get('cpu_count')} cores): {json.dumps(part.get('versions', {}))}; {note}")
    return out, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="+", type=Path, help="bench.kernels reports (--out files) to merge, in order")
    ap.add_argument("--into", type=Path, required=True, help="the record, e.g. bench/results/kernels.json")
    ap.add_argument("--note", required=True, help="how the parts were made: command, commit, session")
    ap.add_argument("--dry-run", action="store_true", help="print what would change; write nothing")
    a = ap.parse_args(argv)
    try:
        record: dict[str, Any] = json.loads(a.into.read_text())
        for path in a.parts:
            record, lines = merge(record, json.loads(path.read_text()), a.note, where=str(path))
            print("\n".join(f"{path.name}: {line}" for line in lines))
    except (OSError, json.JSONDecodeError, MergeError) as e:
        print(f"kernels_merge: {e}", file=sys.stderr)
        return 2
    if not a.dry_run:
        a.into.write_text(json.dumps(record, indent=1) + "\n")  # all parts or none: written once, at the end
        print(f"wrote {a.into}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
