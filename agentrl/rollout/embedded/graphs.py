"""Static-shape decode steps, replayed from CUDA graphs on a GPU: the embedded engine's answer to
being host-bound.

Why: on the H200 (session 7, bench/results/engine_profile_h200.json) SmolLM2-135M made 11.7-15.6
forwards per second at any batch (8 to 64 rows): each forward spent ~37 ms launching its ~400
kernels from Python while the GPU idled. A CUDA graph replays a captured forward's kernels with one
launch, so a decode step costs its GPU time; SGLang does the same per batch-size bucket.

How (everything a graph needs is static):
- KV storage allocated once: one tensor [2, layers, max_rows, kv_heads, capacity, head_dim] whose
  per-layer views are the keys and values [max_rows, kv_heads, capacity, head_dim].
  The scheduler's batch cache (kv.py: rows right-aligned in `width` columns) is *backed* by it:
  its layers are views of rows [0, B) and columns [0, width). The batch changes in place: `join`
  writes only the admitted rows (the running ones move only when the new width is larger), and
  `remove` fills the finished rows' slots with the last rows and drops common left padding only
  when that saves a column bucket or DROP_MIN_COLUMNS columns. Why: an agent's requests arrive
  and stop one by one, so the batch changes at most steps; rebuilding it by copy (kv.py's join /
  select_rows over the whole capacity, then `adopt` copying it back in) moved every running row
  twice per change (in place: +20% tokens/s at 64 such clients on the H200, static 2048,
  bench/results/engine_agent_h200.json). A batch kv.py built (after an eager stretch) is `adopt`ed.
- A step at width W writes column W of every row in place (index_copy_ with a device index) and
  attends over the columns of its column bucket (256, 512, ... capacity: the smallest holding
  W + 1); the mask, computed inside the graph from the rows' left pads and W, hides every column
  outside [pad, W]. Masked columns contribute exact zeros. Why buckets: attending over all 4,096
  columns of a 64-row SmolLM2 batch at widths of ~800 made the GPU the bottleneck (11 ms per
  step waiting on it, 28 steps/s; bench/results/engine_turns_h200.json); with buckets 4.2 ms and
  45 steps/s (bench/results/engine_column_buckets_h200.json).
- One graph per (batch bucket, column bucket), batch buckets 1, 2, 4, ... max_rows, captured at
  first use. Rows between the batch and its bucket are padding: token 0 at position 0, seeing
  only their own column.
- Weights are loaded by copy_ into the same parameter tensors (weights.py), so graphs stay valid
  across weight updates.
- Models: all layers full attention (Llama, Qwen, SmolLM2). DSA (GLM) and sliding-window layers
  (Gemma 3) decode eagerly, as does a batch past max_rows or a width past capacity.
On CPU the same static step runs without capture; the tests compare it with the eager path.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from agentrl.rollout.embedded import kv as kvlib


class GraphCaptureFailed(RuntimeError):
    """A CUDA graph could not be captured (the scheduler then decodes eagerly for good)."""


class UnsupportedModel(ValueError):
    """The model cannot decode on static buffers (the message says why); it decodes eagerly."""


class _StaticLayer(DynamicLayer):
    """A cache layer over fixed buffers: update writes the step's column and returns all of them."""

    _layer_type = None  # never register in transformers' layer-type mapping

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.column = keys, values, column
        self.device, self.is_initialized = keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.column, key_states)
        self.values.index_copy_(2, self.column, value_states)
        return self.keys, self.values


def unsupported_reason(model) -> str | None:
    """Why `model` cannot decode on static buffers, or None if it can."""
    cfg = model.config
    probe = kvlib.new_cache(cfg)
    if any(type(layer) is not kvlib._GrowingLayer for layer in probe.layers):
        return "its cache has DSA layers"
    if getattr(cfg, "sliding_window", None) and "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return "it has sliding-window layers"
    if cfg._attn_implementation != "sdpa":
        return f"attention is {cfg._attn_implementation}, not sdpa"
    return None


COLUMN_BUCKET_MIN = 256  # the smallest column bucket; each one above doubles it, up to capacity
# `remove` shifts the rows left over their common padding (a copy of the whole batch) only when
# that many columns or more are padding everywhere, or when it moves the batch to a smaller column
# bucket, or when the batch nears capacity: one shift per ~64 decode steps at most, not one per finish.
DROP_MIN_COLUMNS = 64


def buckets(max_rows: int, first: int = 1) -> list[int]:
    """first, 2 first, 4 first, ... below max_rows, then max_rows."""
    out, b = [], first
    while b < max_rows:
        out.append(b)
        b *= 2
    return [*out, max_rows]


class StaticDecoder:
    """Decode steps of up to `max_rows` rows and `capacity` KV columns on static buffers."""

    def __init__(self, model, max_rows: int, capacity: int, use_graphs: bool | None = None) -> None:
        why = unsupported_reason(model)
        if why:
            raise UnsupportedModel(f"static decode is not available for this model: {why}")
        cfg, p = model.config, next(model.parameters())
        self.model, self.max_rows, self.capacity = model, max_rows, capacity
        self.device = p.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        heads = cfg.num_key_value_heads
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # One tensor [2 (keys, values), layers, rows, heads, capacity, dim]; self.k[i] / self.v[i] are
        # its layer views. Why one: moving, shifting or copying out a row is then one kernel for every
        # layer at once, not one per layer tensor (60 for SmolLM2); on a GPU each is a launch.
        self.layers = cfg.num_hidden_layers
        self.kv = torch.zeros((2, self.layers, max_rows, heads, capacity, dim), dtype=p.dtype, device=self.device)
        self.k, self.v = list(self.kv[0].unbind(0)), list(self.kv[1].unbind(0))
        self.rows_in = torch.zeros(max_rows, 3, dtype=torch.long, device=self.device)  # token, position, pad
        self.column = torch.zeros(1, dtype=torch.long, device=self.device)  # W: where this step writes
        self.cols = torch.arange(capacity, device=self.device)
        self.buckets = buckets(max_rows)
        self.column_buckets = buckets(capacity, min(COLUMN_BUCKET_MIN, capacity))
        self._caches: dict[tuple[int, int], DynamicCache] = {}
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.stats = {"static_steps": 0, "adopts": 0, "graphs_captured": 0, "joins_in_place": 0,
                      "removes_in_place": 0, "left_shifts": 0, "right_shifts": 0}

    def bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def fits(self, rows: int, width: int) -> bool:
        return rows <= self.max_rows and width + 1 <= self.capacity

    def backs(self, cache: DynamicCache, rows: int) -> bool:
        buf = getattr(cache.layers[0], "_kbuf", None)
        return buf is not None and _same_storage(buf, self.k[0]) and buf.shape[0] == rows \
            and buf.shape[2] == self.capacity

    def adopt(self, cache: DynamicCache, rows: int, width: int) -> None:
        """Copy the batch cache into the static buffers and make its layers views of them."""
        for layer, k, v in zip(cache.layers, self.k, self.v):
            src_k, src_v = layer.keys, layer.values
            if _same_storage(src_k, k):  # already inside (other rows): copy out first
                src_k, src_v = src_k.clone(), src_v.clone()
            k[:rows, :, :width].copy_(src_k)
            v[:rows, :, :width].copy_(src_v)
        self._view(cache, rows, width)
        self.stats["adopts"] += 1

    def _view(self, cache: DynamicCache, rows: int, width: int) -> None:
        for layer, k, v in zip(cache.layers, self.k, self.v):
            kvlib._set_layer(layer, {"keys": k[:rows, :, :width], "values": v[:rows, :, :width]},
                             {"keys": k[:rows], "values": v[:rows]})

    def _column_bucket(self, width: int) -> int:
        return next((c for c in self.column_buckets if c > width), self.capacity + 1)

    def join(self, cache: DynamicCache | None, rows: int, width: int, kvs: list[kvlib.SeqKV],
             new_width: int) -> DynamicCache | None:
        """kv.join in place: the batch `cache` (`rows` rows right-aligned in `width` columns, held in
        these buffers; None or no rows: empty) with `kvs` appended below, every row right-aligned in
        `new_width` >= width columns. Only the new rows are written, plus the running ones shifted
        right when new_width > width. None when the batch is not held here or would not fit (the
        caller then joins by copy). Columns left of a row's start keep whatever finite K/V they held:
        the masks hide them and nothing there is NaN (every write is a computed K/V)."""
        total = rows + len(kvs)
        if total > self.max_rows or not self.fits(total, new_width) or (rows and not self.backs(cache, rows)):
            return None
        if not rows:
            cache, width = kvlib.new_cache(self.model.config), new_width
        shift = new_width - width
        if shift and rows:
            live = self.kv[:, :, :rows]
            live.narrow(4, shift, width).copy_(live.narrow(4, 0, width).clone())
        for j, kv in enumerate(kvs):
            n = kvlib.seq_len(kv)
            src = torch.stack([layer[name][0] for name in ("keys", "values") for layer in kv])  # [2L, H, n, D]
            self.kv[:, :, rows + j].narrow(3, new_width - n, n).copy_(src.view(2, self.layers, *src.shape[1:]))
        self._view(cache, total, new_width)
        self.stats["joins_in_place"] += 1
        self.stats["right_shifts"] += bool(shift and rows)
        return cache

    def remove(self, cache: DynamicCache, rows: int, width: int, keep: list[int],
               drop_left: int) -> tuple[list[int], int] | None:
        """Keep rows `keep` (ascending) of the batch held here, in place: the slots of finished rows
        below len(keep) take the last kept rows (one row copy each); the common left padding
        `drop_left` is dropped only as DROP_MIN_COLUMNS says. Returns (order, width): the old row of
        each new row, and the new width. None when the batch is not held here."""
        if not self.backs(cache, rows):
            return None
        n, kept = len(keep), set(keep)
        holes = [i for i in range(n) if i not in kept]
        movers = [i for i in keep if i >= n]
        order = [i if i in kept else 0 for i in range(n)]
        for hole, mover in zip(holes, movers):
            order[hole] = mover
        if holes:
            src = torch.tensor(movers, dtype=torch.long, device=self.device)
            dst = torch.tensor(holes, dtype=torch.long, device=self.device)
            cols = self.kv.narrow(4, 0, width)
            cols.index_copy_(2, dst, cols.index_select(2, src))
        if drop_left and (drop_left >= DROP_MIN_COLUMNS or width + DROP_MIN_COLUMNS >= self.capacity
                          or self._column_bucket(width - drop_left) < self._column_bucket(width)):
            live = self.kv[:, :, :n]
            live.narrow(4, 0, width - drop_left).copy_(live.narrow(4, drop_left, width - drop_left).clone())
            width -= drop_left
            self.stats["left_shifts"] += 1
        self._view(cache, n, width)
        self.stats["removes_in_place"] += 1
        return order, width

    def copy_row(self, cache: DynamicCache, rows: int, row: int, start: int, length: int) -> kvlib.SeqKV | None:
        """A copy of row `row`, columns [start, start + length), of the batch held here, made with one
        kernel (its layers are views of that copy); None when the batch is not held here."""
        if not self.backs(cache, rows):
            return None
        c = self.kv[:, :, row : row + 1].narrow(4, start, length).clone()
        return [{"keys": c[0, i], "values": c[1, i]} for i in range(self.layers)]

    def step(self, cache: DynamicCache, tokens: list[int], positions: list[int], pads: list[int],
             width: int) -> torch.Tensor:
        """One decode step of the batch held in `cache` (right-aligned in `width` columns): returns
        the next-token logits [rows, vocab] and leaves `cache` holding `width + 1` columns."""
        rows = len(tokens)
        bucket = next(b for b in self.buckets if b >= rows)
        key = (bucket, next(c for c in self.column_buckets if c > width))  # fits() keeps width < capacity
        if not self.backs(cache, rows):
            self.adopt(cache, rows, width)
        extra = bucket - rows  # padding rows: token 0 at position 0, seeing only column `width`
        staged = torch.tensor([*zip(tokens, positions, pads), *[(0, 0, width)] * extra], dtype=torch.long)
        self.rows_in[:bucket].copy_(staged, non_blocking=True)
        self.column.fill_(width)
        if self.use_graphs:
            graph, logits = self._graph(key)
            graph.replay()
        else:
            logits = self._forward(key)
        for layer, k, v in zip(cache.layers, self.k, self.v):
            layer.keys, layer.values = k[:rows, :, : width + 1], v[:rows, :, : width + 1]
        self.stats["static_steps"] += 1
        return logits[:rows, -1]

    def _forward(self, key: tuple[int, int]) -> torch.Tensor:
        bucket, columns = key
        cache = self._caches.get(key)
        if cache is None:
            cache = DynamicCache(config=self.model.config)
            cache.layers = [_StaticLayer(k[:bucket, :, :columns], v[:bucket, :, :columns], self.column)
                            for k, v in zip(self.k, self.v)]
            self._caches[key] = cache
        inp, cols = self.rows_in[:bucket], self.cols[None, :columns]
        seen = (cols >= inp[:, 2:3]) & (cols <= self.column)
        out = self.model(input_ids=inp[:, 0:1], attention_mask=seen[:, None, None, :], position_ids=inp[:, 1:2],
                         cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits

    def _graph(self, key: tuple[int, int]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        if key in self._graphs:
            return self._graphs[key]
        # Warm-up on a side stream (as torch.cuda.graphs asks) with this step's own inputs: it
        # writes the same column the replay writes.
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(key)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: a weight update's receive on another thread must not break the capture.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self._forward(key)
        except RuntimeError as exc:  # an op the model runs that capture refuses (a host sync, say)
            raise GraphCaptureFailed(f"capturing the decode step of {key[0]} rows x {key[1]} columns "
                                     f"failed: {exc}") from exc
        self._graphs[key] = (graph, logits)
        self.stats["graphs_captured"] += 1
        return self._graphs[key]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
