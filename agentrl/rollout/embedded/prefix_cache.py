"""KV of finished (or retracted) sequences, reused by requests that extend their tokens.

An agent's turn k+1 prompt is turn k's prompt + output + observation, so keying by token prefix
finds the previous turn without knowing about sessions. Entries carry the weights epoch that
computed them; a lookup only matches the current epoch, so KV from old weights is never reused.
LRU eviction by total cached tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import count

import numpy as np

from agentrl.rollout.embedded import kv as kvlib


@dataclass
class _Entry:
    tokens: np.ndarray
    kv: kvlib.SeqKV
    epoch: int


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"prefix cache max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._ids = count()
        self.tokens_held = 0

    def __len__(self) -> int:
        return len(self._entries)

    def insert(self, tokens: list[int], kv: kvlib.SeqKV, epoch: int) -> None:
        """Store the KV of `tokens` (kv covers exactly these positions)."""
        n = len(tokens)
        if n == 0 or n > self.max_tokens:
            return
        arr = np.asarray(tokens, dtype=np.int64)
        # An entry that is a prefix of the new one is redundant: the new one serves all its hits.
        for key, entry in list(self._entries.items()):
            m = len(entry.tokens)
            if entry.epoch != epoch or (m <= n and np.array_equal(entry.tokens, arr[:m])):
                self._drop(key)
        self._entries[next(self._ids)] = _Entry(arr, kv, epoch)
        self.tokens_held += n
        while self.tokens_held > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def lookup(self, tokens: list[int], epoch: int, limit: int) -> tuple[kvlib.SeqKV | None, int]:
        """The longest cached prefix of `tokens`, at most `limit` long: (kv views, length)."""
        if limit <= 0 or not self._entries:
            return None, 0
        arr = np.asarray(tokens, dtype=np.int64)
        best_key, best = None, 0
        for key, entry in self._entries.items():
            if entry.epoch != epoch:
                continue
            m = min(len(entry.tokens), len(arr), limit)
            same = entry.tokens[:m] == arr[:m]
            lcp = m if same.all() else int(np.argmin(same))
            if lcp > best:
                best_key, best = key, lcp
        if best_key is None:
            return None, 0
        self._entries.move_to_end(best_key)
        return kvlib.crop(self._entries[best_key].kv, best), best

    def clear(self) -> None:
        self._entries.clear()
        self.tokens_held = 0

    def _drop(self, key: int) -> None:
        self.tokens_held -= len(self._entries.pop(key).tokens)
