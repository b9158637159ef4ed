"""engine_argv for every recipe's engines, checked against SGLang 0.5.23's real flag list
(tests/data/sglang_0_5_23_flags.json, parsed once from its server_args.py) and the embedded CLI's
own options; one golden command line per engine kind."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agentrl.config.loader import load_config
from agentrl.config.plan import EngineSpec, resolve_plan
from agentrl.rollout.engine_cmd import engine_argv

FLAGS = json.loads((Path(__file__).parent / "data" / "sglang_0_5_23_flags.json").read_text())["flags"]
RECIPES = sorted(p.stem for p in (Path(__file__).parents[1] / "configs").glob("*.yaml"))
HOST, DIST, NCCL = "10.0.0.5", "10.0.0.5:40000", 41000


def argv_of(cfg, spec, node_rank=0):
    return engine_argv(cfg, spec, node_rank=node_rank, host=HOST, port=spec.port or 30000,
                       dist_init_addr=DIST if len(spec.nodes) > 1 else None, nccl_port=NCCL)


def flag_pairs(args: list[str], takes_value) -> list[tuple[str, str | None]]:
    """[(flag, value or None)] of an argv tail; fails on a stray positional."""
    out, i = [], 0
    while i < len(args):
        flag = args[i]
        assert flag.startswith("--"), f"stray argument {flag!r} in {args}"
        if takes_value(flag):
            assert i + 1 < len(args) and not args[i + 1].startswith("--"), f"{flag} has no value"
            out.append((flag, args[i + 1]))
            i += 2
        else:
            out.append((flag, None))
            i += 1
    return out


def check_sglang(argv: list[str]) -> dict[str, str | None]:
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    unknown = [a for a in argv[3:] if a.startswith("--") and a not in FLAGS]
    assert not unknown, f"not SGLang 0.5.23 flags: {unknown}"
    pairs = flag_pairs(argv[3:], lambda f: FLAGS[f]["takes_value"])
    seen = [f for f, _ in pairs]
    assert len(seen) == len(set(seen)), f"a flag given twice: {seen}"
    for flag, value in pairs:
        assert not FLAGS[flag]["deprecated"], f"{flag} is deprecated in 0.5.23"
        choices = FLAGS[flag]["choices"]
        assert choices is None or value in choices, f"{flag} {value}: not one of {choices}"
    return dict(pairs)


def embedded_options() -> dict[str, bool]:
    """--option -> takes a value, from the `agentrl engine serve` command itself."""
    import typer

    from agentrl.rollout.engine_cli import app

    cmd = typer.main.get_command(app)
    serve = cmd.commands["serve"] if hasattr(cmd, "commands") else cmd  # a one-command app is that command
    return {o: not p.is_flag for p in serve.params for o in p.opts if o.startswith("--")}


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_engine_command_is_valid(recipe):
    cfg = load_config(recipe)
    plan = resolve_plan(cfg, check_runnable=False)
    kinds = {}
    for spec in plan.engines:
        kinds.setdefault((spec.kind, len(spec.nodes)), spec)
    opts = embedded_options()
    for spec in kinds.values():
        for rank in range(len(spec.nodes)):
            argv = argv_of(cfg, spec, rank)
            if spec.kind == "sglang":
                flags = check_sglang(argv)
                assert argv[0] == cfg.rollout.sglang.python
                assert "--skip-server-warmup" in flags and flags["--nccl-port"] == str(NCCL)
                assert flags["--model-path"] == spec.model_path and flags["--host"] == HOST
            else:
                assert argv[:4] == [sys.executable, "-m", "agentrl.cli", "engine"] and argv[4] == "serve"
                flags = dict(flag_pairs(argv[5:], opts.get))
                assert set(flags) <= set(opts), set(flags) - set(opts)
                assert flags["--device"] == ("cuda" if spec.gpus_per_node else "cpu")


def test_multi_node_sglang_engine_per_node():
    cfg = load_config("glm5_2_tbench2", ["rollout.sglang.gpus_per_engine=8"])  # 2 nodes of 4 GPUs each
    spec = resolve_plan(cfg, check_runnable=False).engines[0]
    assert len(spec.nodes) == 2
    for rank in (0, 1):
        flags = check_sglang(argv_of(cfg, spec, rank))
        assert (flags["--nnodes"], flags["--node-rank"], flags["--dist-init-addr"]) == ("2", str(rank), DIST)
        assert flags["--tp-size"] == "8" and flags["--attn-dp-size"] == "8"
    with pytest.raises(ValueError, match="dist_init_addr"):
        engine_argv(cfg, spec, node_rank=0, host=HOST, port=30000, dist_init_addr=None)
    with pytest.raises(ValueError, match="node_rank 2"):
        engine_argv(cfg, spec, node_rank=2, host=HOST, port=30000, dist_init_addr=DIST)


def test_golden_sglang_command():
    cfg = load_config("glm5_2_tbench2", ["model.rollout_path=/local/glm52-fp8", "rollout.sglang.python=/opt/sgl/bin/python"])
    spec = resolve_plan(cfg, check_runnable=False).engines[0]
    assert argv_of(cfg, spec) == [
        "/opt/sgl/bin/python", "-m", "sglang.launch_server", "--model-path", "/local/glm52-fp8", "--host", HOST,
        "--port", "30000", "--tp-size", "4", "--nccl-port", "41000", "--skip-server-warmup", "--ep-size", "4",
        "--attn-dp-size", "4", "--moe-dense-tp-size", "1", "--enable-dp-lm-head", "--kv-cache-dtype", "fp8_e4m3",
        "--quantization", "fp8", "--attention-backend", "dsa", "--dsa-prefill-backend", "flashmla_sparse",
        "--dsa-decode-backend", "flashmla_kv", "--moe-a2a-backend", "deepep", "--deepep-mode", "auto",
        "--page-size", "64", "--mem-fraction-static", "0.85", "--max-running-requests", "256",
        "--watchdog-timeout", "3600"]


def test_golden_embedded_command_and_placeholders():
    cfg = load_config("local", ["rollout.embedded.dtype=bfloat16", "rollout.embedded.static_decode_len=2048"])
    spec = EngineSpec(3, "embedded", [0, 1], 0.5, 0, "tiny")
    assert engine_argv(cfg, spec, node_rank=1, host="<node ip>", port="<port>", dist_init_addr="<ip of node 0>:<free port>") == [
        sys.executable, "-m", "agentrl.cli", "engine", "serve", "--model", "tiny", "--host", "<node ip>",
        "--port", "<port>", "--device", "cuda", "--dtype", "bfloat16", "--max-batch-size", "32",
        "--prefix-cache-tokens", "262144", "--static-decode-len", "2048", "--admit-wait-steps", "0",
        "--weight-update-timeout-s", "120", "--torch-threads", "1", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "<ip of node 0>:<free port>"]


def test_plan_and_config_disagreeing_on_engine_width_is_refused():
    cfg = load_config("glm5_2_tbench2")
    spec = EngineSpec(0, "sglang", [8], 2.0, 30000, "/m")
    with pytest.raises(ValueError, match="gpus_per_engine=4"):
        engine_argv(cfg, spec, node_rank=0, host=HOST, port=30000, dist_init_addr=None)


def test_serve_names_an_address_it_cannot_listen_on_before_loading_the_model():
    import socket
    import subprocess

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for host, why in (("127.0.0.1", "Address already in use"), ("999.1.1.1", "")):
            r = subprocess.run([sys.executable, "-m", "agentrl.cli", "engine", "serve", "--model", "tiny", "--host", host,
                                "--port", str(port)], capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and "loading" not in r.stderr, r.stderr
            assert f"--host {host} --port {port}: cannot listen there ({why}" in r.stderr
