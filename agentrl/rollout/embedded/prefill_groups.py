"""Which admitted sequences prefill together, and the padded layout of one such forward.

Why: the embedded engine is host-bound on a GPU. Measured on the H200 (session 7,
bench/results/engine_profile_h200.json): SmolLM2-135M ran only 11.7-15.6 model forwards per second
whatever the batch (~37 ms of Python and kernel launches each), and under a closed loop of GRPO-like
clients an 8 s window held 85 prefill forwards against 95 decode steps, because every request with a
prefix-cache hit was prefilled alone. One forward over many rows costs about what one row
costs there, so rows are merged even at the price of some padding.

The layout is the decode layout (kv.py): every row's tokens are contiguous and right-aligned in
`cached + new` columns, with left padding the mask hides. The query part has the width `new` of the
row with the most new tokens; a row with fewer new tokens recomputes the last positions of its
cached prefix instead of reusing them (`reuse` <= its cache hit), and a row shorter than `new` is
left-padded inside the query part (its padding queries see only themselves). So rows with different
cached-prefix lengths and different new-token counts share one forward, every row's positions and
sliding windows stay exact, and the last column holds every row's next-token logits.

Rows that want input logprobs (logprob_start_len >= 0) prefill alone: their logits over the whole
prompt are kept, and a merged row's recomputed positions would shift which logits those are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentrl.rollout.embedded import kv as kvlib
from agentrl.rollout.embedded.request import SeqState

# A merged forward computes rows * new query columns for the real tokens the rows need. Allowed:
# up to this multiple of the real tokens (on the H200 a second forward costs ~37 ms of host time,
# far more than the compute of doubling a prefill of SmolLM2's size) ...
MAX_PAD_RATIO = 2.0
# ... or this many columns more than the real tokens, whichever is larger: short continuations
# (an agent's observation of a few dozen tokens) always merge.
PAD_SLACK_TOKENS = 64
# The same bound for the key columns: rows x width (every row's KV, padded to the longest row, and
# the span every row's attention masks its way over) within MAX_PAD_RATIO of the rows' real columns
# (or PAD_SLACK_TOKENS more per row). Fresh prompts do not merge with a continuation of a long
# context, whose width they would all span; continuations of similar contexts do, whatever their
# length: their cached columns are read, not computed.
# And the memory: rows x width within MAX_CELLS_PER_BUDGET x the step's prefill budget (65,536 columns
# at the default 8,192: 32 continuations of a 2K context, 3 GB of SmolLM2 fp32 KV).
MAX_CELLS_PER_BUDGET = 8
PAD_TOKEN_ID = 0  # what padding query columns feed the model; their outputs are never read


@dataclass
class PrefillRow:
    seq: SeqState
    prefix_kv: kvlib.SeqKV | None  # the cache hit's KV (views), None without one
    hit: int  # cached-prefix length found by the prefix cache
    want_input: bool

    @property
    def new(self) -> int:
        return len(self.seq.tokens) - self.hit


def group_rows(rows: list[PrefillRow], max_tokens: int) -> list[list[PrefillRow]]:
    """Partition rows into prefill forwards. Rows wanting input logprobs are alone; the others, in
    order of length, are merged while (1) the query columns computed, rows x the most new tokens of
    a row, stay within `max_tokens`, the per-step prefill budget (for fresh prompts: rows x width,
    as before), (2) those query columns and the key columns, rows x width, each stay within
    MAX_PAD_RATIO (or PAD_SLACK_TOKENS per row) of the real ones, and (3) rows x width stays within
    MAX_CELLS_PER_BUDGET x `max_tokens`. A row over the budget on its own still prefills (alone)."""
    groups = [[r] for r in rows if r.want_input]
    current: list[PrefillRow] = []
    real = most_new = columns = 0
    for row in sorted((r for r in rows if not r.want_input), key=lambda r: (len(r.seq.tokens), r.new)):
        n = len(current) + 1
        cells = n * len(row.seq.tokens)  # sorted: this row is the longest, so the layout's width
        queries = n * max(most_new, row.new)
        wasteful = (queries > max(MAX_PAD_RATIO * (real + row.new), real + row.new + PAD_SLACK_TOKENS)
                    or cells > max(MAX_PAD_RATIO * (columns + len(row.seq.tokens)),
                                   columns + len(row.seq.tokens) + n * PAD_SLACK_TOKENS))
        if current and (queries > max_tokens or cells > MAX_CELLS_PER_BUDGET * max_tokens or wasteful):
            groups.append(current)
            current, real, most_new, columns = [], 0, 0, 0
        current.append(row)
        real += row.new
        most_new = max(most_new, row.new)
        columns += len(row.seq.tokens)
    if current:
        groups.append(current)
    return groups


class PrefillLayout:
    """Columns of one merged prefill: [0, cached) from the prefix cache, [cached, cached + new)
    computed now; row i's tokens occupy [pads[i], cached + new)."""

    def __init__(self, rows: list[PrefillRow]) -> None:
        self.rows = rows
        self.new = max(r.new for r in rows)
        lengths = [len(r.seq.tokens) for r in rows]
        self.reuse = [max(0, n - self.new) for n in lengths]  # <= hit, since hit = n - r.new
        self.cached = max(self.reuse)
        self.width = self.cached + self.new
        self.pads = [self.width - n for n in lengths]

    def cache(self, config):
        kvs = [kvlib.crop(r.prefix_kv, m) if m else None for r, m in zip(self.rows, self.reuse)]
        return kvlib.stack(config, kvs, self.cached) if self.cached else kvlib.new_cache(config)

    def chunk(self, start: int, count: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and position_ids [B, count] of query columns [start, start + count)."""
        ids = []
        for r, pad in zip(self.rows, self.pads):
            first = start - pad  # token index of the first column (< 0: padding columns come first)
            ids.append([PAD_TOKEN_ID] * min(max(-first, 0), count) + r.seq.tokens[max(first, 0) : max(first + count, 0)])
        cols = torch.arange(start, start + count, device=device)[None, :]
        pos = (cols - torch.tensor(self.pads, device=device)[:, None]).clamp_(min=0)
        return torch.tensor(ids, device=device), pos

    @property
    def computed(self) -> int:
        """Real tokens this forward computes (new ones plus recomputed cached ones)."""
        return sum(len(r.seq.tokens) - m for r, m in zip(self.rows, self.reuse))

    @property
    def padding(self) -> int:
        """Query columns computed for no token: the price of merging rows of different lengths."""
        return len(self.rows) * self.new - self.computed
