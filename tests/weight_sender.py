"""The trainer's side of a distributed weight update, in its own process (torch registers process
groups by name per process, so trainer and engine cannot share one): it hosts the rendezvous with
agentrl.sync.nccl_export.init_weights_update_group, then broadcasts the tensors of a safetensors
file, as ONE flattened bucket in file order (or tensor by tensor), and exits 0."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CHILD = r"""
import os, sys, torch, torch.distributed as dist
from safetensors.torch import load_file
from agentrl.sync.nccl_export import flatten_bucket, init_weights_update_group
port, name, path, mode, order = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5].split(",")
tensors = load_file(path)
pg = init_weights_update_group("127.0.0.1", port, 0, 2, name, backend=sys.argv[6], timeout_s=60)
items = [(n, tensors[n]) for n in order]
if mode == "bucket":
    dist.broadcast(flatten_bucket(items), src=0, group=pg)
else:
    for _, t in items:
        dist.broadcast(t.contiguous(), src=0, group=pg)
dist.destroy_process_group(pg)
sys.stdout.flush()
os._exit(0)  # skip torch's static destructors: the store server torn down at exit while the engine's
             # client is still connected aborted the process (exit -6) in ~1 of 5 loaded runs
"""


def start_sender(port: int, group_name: str, named: dict[str, torch.Tensor], *, bucket: bool = True,
                 backend: str = "gloo", workdir: str | Path | None = None) -> subprocess.Popen:
    from safetensors.torch import save_file

    folder = Path(workdir or tempfile.mkdtemp(prefix="agentrl-sender-"))
    path = folder / "weights.safetensors"
    save_file({n: t.detach().contiguous().cpu() for n, t in named.items()}, str(path))
    return subprocess.Popen([sys.executable, "-c", CHILD, str(port), group_name, str(path),
                             "bucket" if bucket else "direct", ",".join(named), backend])
