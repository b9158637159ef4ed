"""The cuda_ipc transport: a trainer rank and engines on the same GPU.

Each planned bucket is filled into a device buffer (two alternate, so bucket i+1 fills while the
engines load bucket i) and handed over without a copy: `/update_weights_from_tensor` with
`serialized_named_tensors` = [one item per engine TP rank], each the base64 MultiprocessingSerializer
dump of the bucket's (name, view) pairs (agentrl.sync.tensor_ipc.encode: all views share the
buffer's storage, so the engine opens one IPC handle per bucket; the GPU is named by uuid, as
SGLang 0.5.23's patched reductions expect), load_format null. The engine copies the tensors into its
weights before it answers, so the buffer is reused only after every engine has answered.

Scope: one trainer rank (the plan refuses more) and engines of one TP rank on its GPU, e.g.
configs/gpu_smoke.yaml (Ray's fractional GPUs put both on one H200). An engine spanning several
GPUs would need a handle from a trainer rank on each of them.
"""

from __future__ import annotations

import torch

from agentrl.sync.buckets import views
from agentrl.sync.nccl_export import Done
from agentrl.sync.session import EngineLinks
from agentrl.sync.stage import StageSender
from agentrl.sync.transport import StageRequest


class _Pending:
    def __init__(self, links: EngineLinks, futures: dict):
        self.links, self.futures = links, futures

    def wait(self) -> None:
        self.links.collect(self.futures)


class CudaIpcTransport(StageSender):
    kind = "cuda_ipc"

    def __init__(self, *, rank: int = 0, device="cuda"):
        super().__init__(rank=rank, device=device)

    async def prepare(self, links: EngineLinks, request: StageRequest) -> None:
        if self.device.type != "cuda":
            for u in links.live:
                links.failed[u] = "rollout.weight_transport=cuda_ipc needs the trainer on a GPU"
        for u, ranks in zip(request.urls, request.engine_ranks or (), strict=False):
            if ranks != 1:
                links.failed[u] = (f"cuda_ipc sends one handle per engine TP rank from this one trainer rank; the "
                                   f"engine has {ranks} ranks on other GPUs: use rollout.weight_transport=nccl")

    def send_bucket(self, links, request, bucket, flat, last):
        from agentrl.sync.tensor_ipc import encode

        if not links.live:
            return Done()
        torch.cuda.current_stream(flat.device).synchronize()  # the fill is done before another process reads it
        blob = encode(views(flat, bucket))
        version = request.version if last else None
        futures = links.post(links.live, lambda c: c.update_weights_from_tensor(
            [blob], load_format=None, flush_cache=last and request.flush, weight_version=version))
        return _Pending(links, futures)
