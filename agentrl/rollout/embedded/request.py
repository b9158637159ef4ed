"""What the HTTP side submits to the scheduler, what it gets back, and a running sequence."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from agentrl.rollout.embedded import kv as kvlib
from agentrl.rollout.embedded.sampling import RowParams


@dataclass
class GenRequest:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    params: RowParams
    on_done: Callable[[GenOutput], None]  # called on the scheduler thread; must not block
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprob_start_len: int = -1  # >= 0: also return input logprobs from this position


@dataclass
class GenOutput:
    rid: str
    output_ids: list[int]
    logprobs: list[float]
    weight_versions: list[str]
    finish_reason: dict
    prompt_tokens: int
    cached_tokens: int
    weight_version: str
    input_logprobs: list[float | None] | None = None
    error: str | None = None


@dataclass
class SeqState:
    req: GenRequest
    tokens: list[int]
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[float] = field(default_factory=list)
    out_versions: list[str] = field(default_factory=list)
    kv: kvlib.SeqKV | None = None  # only between prefill and joining the batch
    kv_len: int = 0
    cached_tokens: int = 0
    admitted: bool = False
    done: bool = False
    queued_step: int = 0  # the scheduler's decode-step count when it last entered the waiting queue
    input_lps: list[float | None] | None = None
