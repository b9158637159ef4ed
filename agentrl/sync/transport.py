"""The WeightTransport seam: how a trainer's weights reach the engines.

Kinds (rollout.weight_transport, chosen by the plan):
- http_tensors: buckets of tensors through the engine's HTTP API (`/update_weights_from_tensor`
  with safetensors files on a shared host filesystem); embedded engines, one host.
- nccl: SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`, broadcast from
  the trainer's sender rank(s) to every engine rank; engines on other nodes.
- cuda_ipc: `/update_weights_from_tensor` with CUDA IPC handles; a trainer and an engine on one GPU.
"""

from __future__ import annotations

TRANSPORTS = ("http_tensors", "nccl", "cuda_ipc")
# Transports this version implements in the run loop.
IMPLEMENTED = ("http_tensors",)


def transport_refusal(kind: str, engine_kind: str, colocated: bool) -> str | None:
    """None if `kind` can carry weights to `engine_kind` engines, else the reason naming the field."""
    if kind not in TRANSPORTS:
        return f"rollout.weight_transport={kind!r}: use one of {', '.join(TRANSPORTS)}"
    if kind == "http_tensors" and engine_kind == "sglang":
        return ("rollout.weight_transport=http_tensors: SGLang's /update_weights_from_tensor takes CUDA IPC "
                "handles, not files; use nccl (engines on other nodes) or cuda_ipc (one GPU)")
    if kind == "cuda_ipc" and not colocated:
        return "rollout.weight_transport=cuda_ipc needs the engine on the trainer's GPU (cluster.colocate=true)"
    if kind not in IMPLEMENTED:
        return (f"rollout.weight_transport={kind}: this agentrl has no {kind} weight transport in its run loop "
                f"(it has {', '.join(IMPLEMENTED)}); engines could not receive updated weights")
    return None
