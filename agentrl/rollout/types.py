"""The generation contract shared by every engine (SGLang and the embedded one) and its callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)

    def to_sglang(self) -> dict:
        """The `sampling_params` object of SGLang's /generate."""
        out: dict = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p}
        if self.top_k > 0:
            out["top_k"] = self.top_k
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        return out


@dataclass
class GenerateResult:
    """Output of one /generate call: the sampled ids, their logprobs under the sampling
    temperature, and the weight version of every sampled token (a request can straddle an
    update when the engine pauses in_place; otherwise all versions are equal)."""

    output_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: FinishReason
    prompt_tokens: int = 0
    cached_tokens: int = 0
    rid: str | None = None


@runtime_checkable
class Generator(Protocol):
    """What an agent needs from inference: token ids in, token ids + logprobs + versions out.

    `session_id` keeps every turn of an episode on the same engine (prefix-cache reuse)."""

    async def generate(
        self, input_ids: list[int], sampling: SamplingParams, *, session_id: str, rid: str | None = None
    ) -> GenerateResult: ...
