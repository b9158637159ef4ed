"""Weight sync on one GPU (H200): FP8 export against the pre-converted checkpoint, and cuda_ipc.

One call, a few minutes:  python bench/gpu/weight_sync_gpu.py --out bench/results/weight_sync_gpu.json

1. A GLM-MoE-DSA model of a few GB (GLM-5.2's widths, 4 layers: 3 dense + 1 MoE of 32 experts,
   a small vocabulary; random bf16 weights on the GPU) is saved as an HF checkpoint.
2. `prepare --fp8`'s writer (agentrl.models.prepare.write_fp8_checkpoint, quantising on the GPU)
   turns it into the engines' block-FP8 checkpoint; the update path's wire tensors (the
   WeightSource of the same weights with the checkpoint's FP8 names, filled into planned buckets
   exactly as a transport sends them) must equal that checkpoint bit for bit; a few tensors are
   also quantised by the CPU reference, which must give the same bits.
3. An embedded engine process serves the bf16 checkpoint on the same GPU; the bench process holds
   the (perturbed) weights on the GPU and sends them with the cuda_ipc transport through the run's
   session (pause, begin, buckets, end with receipts, continue): GB/s and the engines' pause time
   per round, bf16 and FP8 (the engine dequantises on receipt), and the values read back.
Writes the report with the machine and versions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# GLM-5.2's widths with 4 layers (3 dense, 1 MoE), 32 experts and a 1024-token vocabulary: ~2.6 B
# params, ~5 GB in bf16 (the MoE layer's experts dominate the bytes, as in the real model).
SMALL_GLM = {"num_hidden_layers": 4, "n_routed_experts": 32, "vocab_size": 1024, "num_nextn_predict_layers": 0}
ROUNDS = 3
SPOT_TENSORS = 6  # tensors read back from the engine after an update (first 4096 values each)


def build_model(overrides: dict[str, Any], device: str, seed: int = 0, base: str = "GLM-5.2"):
    """A random GlmMoeDsa of `base`'s shapes with `overrides`, in bf16 on `device`."""
    from transformers import GlmMoeDsaForCausalLM

    from agentrl.models.hf_config import hf_config_for

    torch.manual_seed(seed)
    config = hf_config_for(base, **overrides)
    with torch.device(device):
        model = GlmMoeDsaForCausalLM._from_config(config, dtype=torch.bfloat16)
    return model.eval()


def save_checkpoint(model, folder: Path, device: str) -> dict[str, torch.Tensor]:
    """Save as an HF checkpoint; returns its tensors by checkpoint name (routed experts per expert,
    as transformers writes them and the trainer's export names them) on `device`."""
    from safetensors.torch import load_file

    from agentrl.models.tokenizer import build_tiny_tokenizer

    model.save_pretrained(str(folder))
    build_tiny_tokenizer().save_pretrained(str(folder))  # the engine loads a tokenizer with the model
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update({n: t.to(device) for n, t in load_file(str(shard)).items()})
    return state


def fp8_export_matches(state: dict[str, torch.Tensor], fp8_dir: Path, bucket_bytes: int = 256 << 20) -> dict[str, Any]:
    """The update path's wire bytes (planned buckets of the source, FP8 by the checkpoint's names)
    against the FP8 checkpoint's tensors; also the CPU reference against the GPU kernel."""
    from safetensors.torch import load_file

    from agentrl.sync.buckets import plan_buckets, views
    from agentrl.sync.fp8 import fp8_names_of_checkpoint, quantize
    from agentrl.sync.nccl_export import BucketStream, Done
    from agentrl.sync.source import LocalSource

    ckpt: dict[str, torch.Tensor] = {}
    for shard in sorted(fp8_dir.glob("*.safetensors")):
        ckpt.update(load_file(str(shard)))
    names = fp8_names_of_checkpoint(fp8_dir)
    source = LocalSource(state.items())
    buckets = plan_buckets(source.specs(), bucket_bytes, names)
    mismatched, seen = [], set()

    def check(bucket, flat, last):
        for name, t in views(flat, bucket):
            seen.add(name)
            want = ckpt.get(name)
            if want is None or want.dtype != t.dtype or not torch.equal(want.view(torch.uint8), t.cpu().view(torch.uint8)):
                mismatched.append(name)
        return Done()

    device = next(iter(state.values())).device
    stream = BucketStream(buckets, device, check)
    t0 = time.perf_counter()
    source.run(stream.put, names)
    stream.close()
    export_s = time.perf_counter() - t0
    cpu_same = []
    for name in sorted(names)[:3]:
        q_gpu, s_gpu = quantize(state[name])
        q_cpu, s_cpu = quantize(state[name].cpu())
        cpu_same.append(bool(torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
                             and torch.equal(s_gpu.cpu(), s_cpu)))
    return {"fp8_tensors": len(names), "wire_tensors": len(seen), "checkpoint_tensors": len(ckpt),
            "covers_checkpoint": seen == set(ckpt), "mismatched": mismatched[:10],
            "equal_bitwise": not mismatched and seen == set(ckpt), "cpu_reference_equals_gpu_kernel": all(cpu_same),
            "export_s": export_s, "buckets": len(buckets)}


class EngineProcess:
    """The embedded engine serving `model_dir` on the GPU, in its own process (CUDA IPC is between processes)."""

    def __init__(self, model_dir: Path, log: Path, timeout_s: float = 600.0):
        from agentrl.cluster.engine_process import free_port

        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        # The run's own engine command line (a one-command Typer app takes no "serve" argument).
        self.cmd = [sys.executable, "-m", "agentrl.cli", "engine", "serve", "--model", str(model_dir), "--port", str(self.port), "--device", "cuda",
                    "--dtype", "bfloat16", "--max-batch-size", "4", "--weight-update-timeout-s", "300"]
        self.log, self.timeout_s, self.proc = log, timeout_s, None
        self._log_file = None

    def __enter__(self) -> str:
        import httpx

        self._log_file = open(self.log, "w")  # closed in __exit__
        self.proc = subprocess.Popen(self.cmd, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the engine exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"the engine was not ready within {self.timeout_s} s; see {self.log}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self._log_file is not None:
            self._log_file.close()


async def cuda_ipc_rounds(url: str, state: dict[str, torch.Tensor], fp8: frozenset[str], rounds: int,
                          bucket_bytes: int, version0: int) -> dict[str, Any]:
    """`rounds` full updates over cuda_ipc through the run's session; the served values checked."""
    from agentrl.rollout.client import EngineClient
    from agentrl.rollout.embedded.weights import dequantize_fp8_weights
    from agentrl.sync.cuda_ipc import CudaIpcTransport
    from agentrl.sync.fp8 import to_wire
    from agentrl.sync.session import EngineSession, run_update
    from agentrl.sync.source import LocalSource
    from agentrl.sync.transport import StageRequest

    source = LocalSource(state.items())
    transport = CudaIpcTransport(device=next(iter(state.values())).device)
    runs = []
    for i in range(rounds):
        def request(stage: int, live: list[str], v=version0 + i) -> StageRequest:
            return StageRequest(stage, tuple(live), v, True, True, fp8, bucket_bytes, 300.0, (1,) * len(live))

        out = await run_update(EngineSession([url], pause_mode="retract", timeout_s=300.0), 1, request,
                               lambda req: transport.send_stage(source, req))
        if out["failed_engines"]:
            raise RuntimeError(f"cuda_ipc update failed: {out['failed_engines']}")
        runs.append(out)
    spot = sorted(state)[:: max(len(state) // SPOT_TENSORS, 1)][:SPOT_TENSORS]
    async with EngineClient(url, timeout_s=120) as c:
        served = {n: await c.get_weights_by_name(n, truncate_size=4096) for n in spot}
        version = await c.weight_version()
    want = {}
    for n in spot:
        wire = dict(to_wire(n, state[n], n in fp8))
        want[n] = dequantize_fp8_weights(wire)[n] if n in fp8 else state[n]
    same = all(served[n] == want[n].to(torch.bfloat16).float().reshape(-1)[:4096].cpu().tolist() for n in spot)
    secs = [r["sync_s"] for r in runs]
    return {"fp8": bool(fp8), "bytes": runs[0]["sync_bytes"], "buckets": runs[0]["sync_buckets"], "rounds": rounds,
            "sync_s": secs, "sync_paused_s": [r["sync_paused_s"] for r in runs],
            "gbps_median": runs[0]["sync_bytes"] / statistics.median(secs) / 1e9,
            "gbps_best": runs[0]["sync_bytes"] / min(secs) / 1e9,
            "paused_s_median": statistics.median(r["sync_paused_s"] for r in runs),
            "engine_weight_version": version, "version_stamped": version == version0 + rounds - 1,
            "served_values_match": same, "spot_tensors": spot}


def versions() -> dict[str, Any]:
    from bench.machine import machine

    out = machine()
    out["cuda_runtime"] = torch.version.cuda
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - a CPU build has no NCCL
        out["nccl"] = None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "weight_sync_gpu.json")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--bucket-mb", type=int, default=256)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from agentrl.models.prepare import write_fp8_checkpoint
    from agentrl.sync.fp8 import fp8_names_of_checkpoint

    report: dict[str, Any] = {"benchmark": "weight_sync_gpu", "machine": versions(), "model": dict(SMALL_GLM)}
    with tempfile.TemporaryDirectory(prefix="agentrl-wsg-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        model = build_model(SMALL_GLM, "cuda")
        state = save_checkpoint(model, tmp / "hf", "cuda")
        del model
        torch.cuda.empty_cache()
        report["model"].update(params_b=sum(t.numel() for t in state.values()) / 1e9,
                               bf16_gb=sum(t.numel() * t.element_size() for t in state.values()) / 1e9)
        t1 = time.perf_counter()
        counts = write_fp8_checkpoint(tmp / "hf", tmp / "fp8", device="cuda")
        report["fp8_checkpoint"] = {**counts, "write_s": time.perf_counter() - t1, "build_and_save_s": t1 - t0}
        report["fp8_export"] = fp8_export_matches(state, tmp / "fp8", args.bucket_mb << 20)
        with torch.no_grad():  # the trainer's step: every weight moves, so an update is visible
            for t in state.values():
                if t.is_floating_point():
                    t.mul_(1.0078125)
        with EngineProcess(tmp / "hf", tmp / "engine.log") as url:
            names = fp8_names_of_checkpoint(tmp / "fp8")
            bf16 = asyncio.run(cuda_ipc_rounds(url, state, frozenset(), args.rounds, args.bucket_mb << 20, 1))
            fp8 = asyncio.run(cuda_ipc_rounds(url, state, names, args.rounds, args.bucket_mb << 20, 1 + args.rounds))
        report["cuda_ipc"] = {"bucket_mb": args.bucket_mb, "bf16": bf16, "fp8": fp8}
    report["ok"] = bool(report["fp8_export"]["equal_bitwise"] and report["fp8_export"]["cpu_reference_equals_gpu_kernel"]
                        and bf16["served_values_match"] and fp8["served_values_match"] and bf16["version_stamped"]
                        and fp8["version_stamped"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"ok": report["ok"], "fp8_equal": report["fp8_export"]["equal_bitwise"],
                      "cuda_ipc_gbps_bf16": bf16["gbps_median"], "paused_s_bf16": bf16["paused_s_median"],
                      "cuda_ipc_gbps_fp8": fp8["gbps_median"]}))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
