"""`agentrl engine ...`: run the embedded CPU engine (SGLang's native HTTP API) as a process."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Run the embedded inference engine.")


@app.command("serve")
def serve(
    model: Annotated[str, typer.Option("--model", help="Named model (tiny, smollm2-135m) or an HF folder.")],
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port; 0 picks a free one.")],
    host: Annotated[str, typer.Option("--host", help="Bind address.")] = "127.0.0.1",
    max_batch_size: Annotated[int, typer.Option(min=1, help="Most sequences decoded together.")] = 32,
    prefix_cache_tokens: Annotated[int, typer.Option(min=0, help="Tokens of finished KV kept for reuse.")] = 262144,
    torch_threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads; default: torch's.")] = None,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    seed: Annotated[int, typer.Option(help="Sampling seed (and the tiny model's init seed).")] = 0,
    cache_dir: Annotated[Path | None, typer.Option(help="Where converted named models are cached.")] = None,
) -> None:
    """Load the model and serve /generate, weight updates and control endpoints until Ctrl-C."""
    import torch
    from aiohttp import web

    from agentrl.models.policy import load_policy
    from agentrl.rollout.embedded.server import EmbeddedEngineServer

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise typer.BadParameter(f"--dtype {dtype!r}: use float32 or bfloat16")
    if torch_threads:
        torch.set_num_threads(torch_threads)
    try:
        policy, tokenizer = load_policy(model, dtypes[dtype], seed=seed, cache_dir=cache_dir)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    server = EmbeddedEngineServer(policy, tokenizer, model_path=model, max_batch_size=max_batch_size,
                                  prefix_cache_tokens=prefix_cache_tokens, seed=seed)
    typer.echo(f"embedded engine: {model} (max batch {max_batch_size})")
    web.run_app(server.app(), host=host, port=port, access_log=None, print=typer.echo)  # prints the bound URL
