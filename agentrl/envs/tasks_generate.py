"""`agentrl tasks generate`: write generated terminal-bench-2 tasks (envs/tbench2/generate).

Registered on the `tasks` app in agentrl/envs/tasks_cli.py. Only typer and the standard library
are imported here; the generator is imported inside the command.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer


def generate(
    out: Annotated[Path | None, typer.Argument(help="New (or empty) folder to write the tasks into.")] = None,
    families: Annotated[
        str | None, typer.Option(help="Comma-separated family names; default: every family.")
    ] = None,
    instances: Annotated[int, typer.Option(min=1, help="Instances per family.")] = 4,
    seed: Annotated[int, typer.Option(help="Seed of the instances' parameters.")] = 0,
    splits: Annotated[
        bool,
        typer.Option("--splits", help="Write the repo's held-out split set instead: INSTANCES per training "
                     "family, the held-out families and held-out instances, and SPLITS.json."),
    ] = False,
    list_families: Annotated[bool, typer.Option("--list", help="List the families and exit.")] = False,
) -> None:
    """Write task folders (instruction.md, task.toml, environment/, solution/solve.sh, tests/test.sh)
    drawn from parameterised families of shell skills. The same arguments write the same bytes.
    Check them with `agentrl tasks check OUT`."""
    from envs.tbench2.generate.build import generate_split_set, generate_tasks
    from envs.tbench2.generate.registry import all_families
    from envs.tbench2.generate.splits import load_heldout_splits

    if list_families:
        held_out = set(load_heldout_splits().heldout_families)
        for fam in all_families().values():
            mark = "held-out" if fam.name in held_out else "train"
            print(f"{fam.name:22} {fam.kind:12} {mark:9} {fam.summary}")
        return
    if out is None:
        raise typer.BadParameter("give the folder to write into (or --list)", param_hint="OUT")
    names = [n.strip() for n in families.split(",") if n.strip()] if families else None
    if splits and names:
        raise typer.BadParameter("--splits uses the families of SPLITS.json; leave --families out",
                                 param_hint="--families")
    try:
        manifest = generate_split_set(out, instances, seed) if splits else generate_tasks(out, names, instances, seed)
    except (ValueError, FileExistsError) as err:
        typer.echo(f"cannot generate: {err}", err=True)
        raise typer.Exit(2) from None
    print(f"wrote {len(manifest['tasks'])} tasks to {out}", file=sys.stderr)
