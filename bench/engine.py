"""`agentrl bench engine`: embedded-engine throughput by concurrency, and the client's overhead.

Each model is served by its own `agentrl engine serve` process (as in a run: the HTTP client and
the engine do not share a GIL). At every concurrency c, c requests of `prompt_tokens` random
prompt tokens and exactly `new_tokens` generated tokens (ignore_eos) run at once, `rounds` times;
tokens/s = generated tokens / wall time. `batching_speedup_c` = tokens/s at c over tokens/s at 1.
Client overhead = the client's round-trip time minus the engine's own e2e_latency, for 1-token
requests sent one at a time (JSON, HTTP, event loops on both sides).
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.machine import machine

GOAL_BATCHING_SPEEDUP_32 = 8.0


def run_engine_bench(out_path: str | Path, models: tuple[str, ...] = ("tiny", "smollm2-135m"),
                     concurrency: tuple[int, ...] = (1, 8, 32), *, prompt_tokens: int = 64, new_tokens: int = 64,
                     rounds: int = 2, overhead_requests: int = 20, torch_threads: int | None = None,
                     startup_timeout_s: float = 300.0, seed: int = 0) -> dict:
    """Benchmark each model at each concurrency; write and return the JSON report."""
    if not models or not concurrency or min(concurrency) < 1:
        raise ValueError("models must be non-empty and every concurrency >= 1")
    if prompt_tokens < 1 or new_tokens < 1 or rounds < 1:
        raise ValueError("prompt_tokens, new_tokens and rounds must be >= 1")
    host = machine()
    report: dict = {"benchmark": "engine", "machine": host, "versions": {**host["versions"], **_versions()},
                    "settings": {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "rounds": rounds,
                                 "concurrency": list(concurrency), "torch_threads": torch_threads},
                    "models": {}}
    for model in models:
        with _EngineProcess(model, max(concurrency), torch_threads, seed, startup_timeout_s) as url:
            report["models"][model] = asyncio.run(
                _bench_model(url, concurrency, prompt_tokens, new_tokens, rounds, overhead_requests, seed))
    tiny = report["models"].get("tiny", {})
    if "batching_speedup_32" in tiny:
        report["batching_speedup_32"] = tiny["batching_speedup_32"]
        report["batching_speedup_32_goal"] = GOAL_BATCHING_SPEEDUP_32
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report


async def _bench_model(url: str, concurrency, prompt_tokens: int, new_tokens: int, rounds: int,
                       overhead_requests: int, seed: int) -> dict:
    import random

    from agentrl.rollout.client import EngineClient

    rng = random.Random(seed)
    async with EngineClient(url, timeout_s=3600) as client:
        vocab = (await client.model_info())["vocab_size"]

        def payload(n_new: int) -> dict:
            return {"input_ids": [rng.randrange(vocab) for _ in range(prompt_tokens)], "return_logprob": True,
                    "sampling_params": {"max_new_tokens": n_new, "temperature": 1.0, "ignore_eos": True}}

        await client.generate_raw(payload(4))  # warm-up
        result: dict = {"levels": {}}
        for c in concurrency:
            generated, start = 0, time.perf_counter()
            for _ in range(rounds):
                outs = await asyncio.gather(*(client.generate_raw(payload(new_tokens)) for _ in range(c)))
                generated += sum(len(o["output_ids"]) for o in outs)
            wall = time.perf_counter() - start
            await client.flush_cache()  # the next level must not reuse this one's KV
            info = (await client.server_info())["internal_states"][0]
            result["levels"][str(c)] = {"tokens_per_s": generated / wall, "wall_s": wall, "generated_tokens": generated,
                                        "max_decode_batch_size": info["max_decode_batch_size"]}
        base = result["levels"][str(concurrency[0])]["tokens_per_s"] if concurrency[0] == 1 else None
        for c in concurrency:
            if base:
                result[f"batching_speedup_{c}"] = result["levels"][str(c)]["tokens_per_s"] / base
        overheads = []
        for _ in range(overhead_requests):
            t0 = time.perf_counter()
            out = await client.generate_raw(payload(1))
            overheads.append(time.perf_counter() - t0 - out["meta_info"]["e2e_latency"])
        result["client_overhead_ms"] = {"mean": 1e3 * statistics.fmean(overheads),
                                        "p50": 1e3 * statistics.median(overheads), "n": len(overheads)}
    return result


class _EngineProcess:
    """`agentrl engine serve` in a child process; stopped (by its own pid) on exit."""

    def __init__(self, model: str, max_batch: int, torch_threads: int | None, seed: int, timeout_s: float) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.cmd = [sys.executable, "-m", "agentrl.cli", "engine", "serve", "--model", model, "--port", str(self.port),
                    "--max-batch-size", str(max_batch), "--seed", str(seed)]
        if torch_threads:
            self.cmd += ["--torch-threads", str(torch_threads)]
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        import httpx

        self._log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty child never blocks
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.seek(0)
                raise RuntimeError(f"engine for {self.cmd[6]!r} exited: {self._log.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise TimeoutError(f"engine for {self.cmd[6]!r} not ready after {self.timeout_s}s")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self._log.close()


def _versions() -> dict:
    import aiohttp

    return {"aiohttp": aiohttp.__version__}
