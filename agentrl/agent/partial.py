"""Partial rollout: one turn's generation, continued across weight updates (rollout.partial).

At a weight update the engines pause with `abort`: every running request ends at once with the
tokens it has (finish_reason "abort", HTTP 200; SGLang 0.5.23 turns aborts for errors into HTTP
errors, and a timeout or a dead engine raises in the client, so none of those look like this).
The turn keeps those tokens, each with the version that produced it, and asks again with
prompt + tokens so far for the rest of its budget; the engine holds the request until the update
ends and prefills the whole prefix under the new weights, so no old KV meets new weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentrl.rollout.types import GenerateResult

# Continuations of one turn before an abort is taken for an engine failure instead of an update.
# A turn continued this often has spanned 64 weight updates: far past any staleness bound
# (buffer.max_staleness defaults to 4), so something other than updates is aborting it.
MAX_RESUMES_PER_TURN = 64


@dataclass
class OpenTurn:
    """The reply of a turn in progress: its budget and the tokens sampled so far."""

    budget: int  # max_new_tokens of the whole turn
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    resumes: int = 0  # continuations of this turn (in this process)

    @property
    def left(self) -> int:
        return self.budget - len(self.ids)

    def add(self, piece: GenerateResult) -> None:
        self.ids += piece.output_ids
        self.logprobs += [float(x) for x in piece.logprobs]
        self.versions += [int(v) for v in piece.weight_versions]

    def result(self, finish_reason: str) -> GenerateResult:
        """The whole turn as one generation result (the last piece's finish reason)."""
        return GenerateResult(list(self.ids), list(self.logprobs), list(self.versions), finish_reason)
