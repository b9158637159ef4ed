"""The WeightTransport seam: how one pipeline stage's weights reach the engines.

Kinds (rollout.weight_transport, chosen by the plan):
- http_tensors: buckets as safetensors files on the engines' host, `/update_weights_from_tensor`
  (load_format safetensors_path); embedded engines on the trainer's host (agentrl.sync.weights).
- nccl: SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`, one broadcast
  group per pipeline stage from the stage's sender to every engine rank; gloo on CPU, NCCL on GPU
  (agentrl.sync.nccl).
- cuda_ipc: `/update_weights_from_tensor` with SGLang's serialized CUDA IPC handles, for a trainer
  and an engine on the same GPU (agentrl.sync.cuda_ipc).

An update (agentrl.sync.update.UpdateDriver) pauses the engines and opens their weight-update
session, asks every stage's ranks in turn to `send_stage`, then closes the session and resumes.
Stages go one after another: an engine processes update requests one at a time, so two stages'
broadcasts in flight to the same engines could each wait for an engine busy with the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

TRANSPORTS = ("http_tensors", "nccl", "cuda_ipc")
IMPLEMENTED = ("http_tensors", "nccl", "cuda_ipc")


@dataclass(frozen=True)
class StageRequest:
    """What one stage sends, to whom. `engine_ranks`: TP ranks of each engine (in `urls` order)."""

    stage: int
    urls: tuple[str, ...]
    version: int
    last_stage: bool  # its last bucket stamps the version and flushes the engines' cache
    flush: bool  # False when engines pause in_place (SGLang refuses a flush while requests hold KV)
    fp8: frozenset[str] = frozenset()  # HF names sent FP8 block-quantised
    bucket_bytes: int = 256 << 20
    timeout_s: float = 600.0  # bound on every collective and HTTP call of the update
    engine_ranks: tuple[int, ...] = ()
    fp8_rule: bool = False  # the stage's ranks add agentrl.sync.fp8.fp8_rule's names of their specs


@dataclass
class StageResult:
    """The sender's account of one stage (other ranks return an empty one, `sender` False)."""

    sender: bool = False
    bytes: int = 0
    buckets: int = 0
    tensors: int = 0  # HF tensors sent to each engine
    names_digest: str = ""  # agentrl.sync.buckets.names_digest of those HF names
    seconds: float = 0.0
    failed: dict[str, str] = field(default_factory=dict)  # engine url -> why its transfer failed
    broken: bool = False  # the transfer broke off: engines in `urls` may lack some of this stage

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StageResult:
        return cls(**d)


@runtime_checkable
class WeightTransport(Protocol):
    """One trainer rank's side of a transport. Contracts:
    - `send_stage` is awaited on every rank of the stage (ranks that hold no part return at once);
      the stage's sender posts every bucket of `source` (agentrl.sync.buckets plans them from
      `source.specs()`) to every engine in `request.urls`, exactly once, the last bucket of the last
      stage with the version and the flush;
    - it never raises for an engine's fault and never waits longer than `request.timeout_s` on one
      call: an engine that fails is named in `failed`; if the failure may have cut others off
      (a broadcast group with a dead member), `broken` is set and the caller sends the stage again
      to the engines still alive (groups are rebuilt for the new set);
    - every rank walks the whole source even after a failure, so the trainer's own collectives
      (TP gathers, expert sends) stay in step;
    - `close` releases groups and buffers; it is idempotent."""

    kind: str

    async def send_stage(self, source: Any, request: StageRequest) -> StageResult: ...

    def close(self) -> None: ...


def transport_refusal(kind: str, engine_kind: str, colocated: bool, *, trainer_ranks: int = 1,
                      serves_fp8: bool = False, fp8_updates: bool = False) -> str | None:
    """None if `kind` can carry weights to `engine_kind` engines, else the reason naming the field.
    `serves_fp8`: SGLang engines serve FP8 (rollout.sglang.quantization=fp8: a pre-converted FP8
    checkpoint, or a bf16 one quantised online); `fp8_updates`: updates are sent FP8
    (rollout.weight_sync_fp8). An FP8-serving engine needs FP8 updates (the FP8 tensors and their
    block scales), a bf16-serving SGLang engine has no FP8 parameters to load them into; the
    embedded engine dequantises FP8 updates on receipt and takes either."""
    if kind not in TRANSPORTS:
        return f"rollout.weight_transport={kind!r}: use one of {', '.join(TRANSPORTS)}"
    if kind == "http_tensors" and engine_kind == "sglang":
        return ("rollout.weight_transport=http_tensors: SGLang's /update_weights_from_tensor takes CUDA IPC "
                "handles, not files; use nccl (engines on other nodes) or cuda_ipc (one GPU)")
    if kind == "cuda_ipc" and not colocated:
        return "rollout.weight_transport=cuda_ipc needs the engine on the trainer's GPU (cluster.colocate=true)"
    if kind == "cuda_ipc" and trainer_ranks != 1:
        return (f"rollout.weight_transport=cuda_ipc sends from one trainer rank sharing its GPU with the engines; "
                f"this plan has {trainer_ranks} trainer ranks: use nccl")
    if kind not in IMPLEMENTED:
        return (f"rollout.weight_transport={kind}: this agentrl has no {kind} weight transport in its run loop "
                f"(it has {', '.join(IMPLEMENTED)}); engines could not receive updated weights")
    if engine_kind == "sglang" and serves_fp8 and not fp8_updates:
        return ("rollout.sglang.quantization=fp8 with bf16 weight updates: SGLang 0.5.23 does not re-quantise bf16 "
                "updates correctly for this architecture (its online-FP8 reload is audited for Qwen2/3 only); "
                "serve the pre-converted FP8 checkpoint (`prepare --fp8`, model.rollout_path) and set "
                "rollout.weight_sync_fp8=true, or set rollout.sglang.quantization=none for bf16 serving")
    if engine_kind == "sglang" and fp8_updates and not serves_fp8:
        return ("rollout.weight_sync_fp8=true sends FP8 weights and block scales, but the SGLang engines serve bf16 "
                "(rollout.sglang.quantization=none) and have no FP8 parameters to load them into; set "
                "rollout.sglang.quantization=fp8 with the FP8 checkpoint, or rollout.weight_sync_fp8=false")
    return None

