"""Per-sequence KV tensors and the left-padded batch cache built from them.

Every running sequence owns its KV as plain tensors (`SeqKV`: one dict per layer). One decode
step runs all sequences together on a transformers `DynamicCache` whose rows are right-aligned:
row i has `pad_i = width - len_i` unused columns on the left that the 4-D mask hides. The batch
cache is rebuilt only when the set of sequences changes (admission, finish, retract); a plain
decode step writes one column in place into preallocated headroom (`_GrowingLayer`), where
transformers' DynamicLayer would torch.cat the whole cache (measured with SmolLM2-135M dims,
8 layers, B=32, T=1024, one core: ~300 ms per step in place vs ~800-1100 ms with cat). That works for any model whose cache layers are
`DynamicLayer` (Llama-like: keys/values [B, H, T, D]) or `DynamicIndexedLayer` (GLM-MoE-DSA:
compressed MLA latents [B, 1, T, r] plus the DSA indexer keys [B, T, d]); the DSA indexer adds the
same mask to its scores, so padded columns are never selected ahead of real ones.

Measured (tiny GLM, fp32, CPU): a left-padded row and a solo forward agree to 2e-7; incremental
decode and a full teacher-forced forward agree to 3e-7 (with enough indexer heads: with 4 heads
the DSA scores tie at exactly 0 after ReLU and top-k tie-breaking differs by kernel path).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import (
    DynamicCache,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
)

# Tensor attribute of a cache layer -> its sequence dimension.
SEQ_DIM = {"keys": -2, "values": -2, "indexer_keys": 1}

SeqKV = list[dict[str, torch.Tensor]]  # one {attr: tensor with batch 1} per layer
BUFFERS = {"keys": "_kbuf", "values": "_vbuf", "indexer_keys": "_ibuf"}
GROW_FACTOR, GROW_MIN = 1.5, 32


def _grow(buf: torch.Tensor | None, view: torch.Tensor, new: torch.Tensor, dim: int):
    """Append `new` after `view` (a prefix of `buf` along `dim`, or unbuffered when buf is None)
    in place, reallocating with headroom when full. Returns (buffer, new view)."""
    dim = dim % new.dim()
    cur = view.shape[dim] if view.numel() else 0
    need = cur + new.shape[dim]
    if buf is None or need > buf.shape[dim]:
        shape = list(new.shape)
        shape[dim] = max(need + GROW_MIN, int(need * GROW_FACTOR))
        fresh = new.new_empty(shape)
        if cur:
            fresh.narrow(dim, 0, cur).copy_(view)
        buf = fresh
    buf.narrow(dim, cur, new.shape[dim]).copy_(new)
    return buf, buf.narrow(dim, 0, need)


class _GrowingLayer(DynamicLayer):
    """DynamicLayer that appends into preallocated buffers instead of torch.cat: a decode step then
    copies one column, not the whole cache (measured: cat of SmolLM2-sized KV at B=32, T=1024 costs
    ~750 ms per step on one core, more than the forward itself)."""

    _layer_type = None  # never register in transformers' global layer-type mapping
    _kbuf = _vbuf = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._kbuf, self.keys = _grow(self._kbuf, self.keys, key_states, SEQ_DIM["keys"])
        self._vbuf, self.values = _grow(self._vbuf, self.values, value_states, SEQ_DIM["values"])
        return self.keys, self.values


class _GrowingIndexedLayer(DynamicIndexedLayer):
    _layer_type = None
    _kbuf = _vbuf = _ibuf = None
    update = _GrowingLayer.update

    def update_indexer(self, indexer_key_states):
        if not self.is_indexer_initialized:
            self.lazy_initialization_indexer(indexer_key_states)
        self._ibuf, self.indexer_keys = _grow(self._ibuf, self.indexer_keys, indexer_key_states,
                                              SEQ_DIM["indexer_keys"])
        return self.indexer_keys


def new_cache(config) -> DynamicCache:
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer):  # full KV kept; the window is in the mask
            cache.layers[i] = _GrowingLayer()
        elif type(layer) is DynamicIndexedLayer:
            cache.layers[i] = _GrowingIndexedLayer()
        else:
            raise ValueError(
                f"embedded engine: cache layer {i} is {type(layer).__name__}; only full-attention "
                "(DynamicLayer) and DSA (DynamicIndexedLayer) layers are supported"
            )
    return cache


def _layer_tensors(layer) -> dict[str, torch.Tensor]:
    if not layer.is_initialized:
        return {}
    out = {"keys": layer.keys, "values": layer.values}
    if isinstance(layer, DynamicIndexedLayer):
        if layer.indexer_position_ids is not None:
            raise ValueError("embedded engine: indexer position ids in the cache are not supported")
        if layer.is_indexer_initialized:
            out["indexer_keys"] = layer.indexer_keys
    return out


def _set_layer(layer, tensors: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor] | None = None) -> None:
    """Point the layer at `tensors`; `buffers` (same names) are what they are prefixes of, if any."""
    for name, attr in BUFFERS.items():
        setattr(layer, attr, (buffers or {}).get(name))
    if not tensors:
        return
    layer.keys, layer.values = tensors["keys"], tensors["values"]
    layer.device = layer.keys.device
    layer.is_initialized = True
    if "indexer_keys" in tensors:
        ik = tensors["indexer_keys"]
        layer.indexer_keys = ik
        layer.indexer_dtype, layer.indexer_device = ik.dtype, ik.device
        layer.is_indexer_initialized = True


def _seq_slice(t: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    return t.narrow(dim % t.dim(), start, stop - start)


def seq_len(kv: SeqKV) -> int:
    for layer in kv:
        if "keys" in layer:
            return layer["keys"].shape[SEQ_DIM["keys"]]
    return 0


def extract(cache: DynamicCache, row: int, start: int, length: int) -> SeqKV:
    """Row `row`, columns [start, start + length) of the batch cache, as views."""
    out: SeqKV = []
    for layer in cache.layers:
        out.append(
            {name: _seq_slice(t[row : row + 1], SEQ_DIM[name], start, start + length)
             for name, t in _layer_tensors(layer).items()}
        )
    return out


def crop(kv: SeqKV, length: int) -> SeqKV:
    """The first `length` positions of a sequence's KV, as views."""
    return [{name: _seq_slice(t, SEQ_DIM[name], 0, length) for name, t in layer.items()} for layer in kv]


def stack(config, kvs: list[SeqKV | None], width: int) -> DynamicCache:
    """A batch cache whose row i holds kvs[i] right-aligned in `width` columns (zeros on the left).

    A row given as None (or with no positions) is all padding: a prefill row with no cached prefix."""
    cache = new_cache(config)
    if len(kvs) == 1 and kvs[0] is not None and seq_len(kvs[0]) == width:  # one unpadded row: share, no copy
        for layer, tensors in zip(cache.layers, kvs[0]):
            _set_layer(layer, tensors)
        return cache
    filled = [kv for kv in kvs if kv is not None and seq_len(kv) > 0]
    if not filled or width == 0:
        return cache
    capacity = max(width + GROW_MIN, int(width * GROW_FACTOR))  # headroom for the decode steps
    for li, layer in enumerate(cache.layers):
        views, buffers = {}, {}
        for name in filled[0][li]:
            dim = SEQ_DIM[name]
            first = filled[0][li][name]
            shape = list(first.shape)
            shape[0] = len(kvs)
            shape[dim % first.dim()] = capacity
            buf = first.new_zeros(shape)
            for row, kv in enumerate(kvs):
                if kv is None or name not in kv[li]:
                    continue
                t = kv[li][name]
                n = t.shape[dim]
                _seq_slice(buf[row : row + 1], dim, width - n, width).copy_(t)
            buffers[name], views[name] = buf, _seq_slice(buf, dim, 0, width)
        _set_layer(layer, views, buffers)
    return cache


def join(config, cache: DynamicCache | None, width: int, kvs: list[SeqKV], new_width: int) -> DynamicCache:
    """The batch cache `cache` (rows right-aligned in `width` columns; None or width 0: no rows) with
    the rows `kvs` appended below, every row right-aligned in `new_width` >= width columns.

    The rows already there move with one copy per cache tensor, the new rows with one each. Taking
    every running row out (`extract`) and stacking them again costs a Python slice and a copy per
    row and layer: on the H200 ~0.5 ms per running row plus ~40 ms per stack with SmolLM2 at 64 rows
    (engine_profile_h200.json), paid at every admission into a running batch."""
    if cache is None or width == 0:
        return stack(config, kvs, new_width)
    if new_width < width:
        raise ValueError(f"join: new_width {new_width} < width {width}: rows are never cut")
    out = new_cache(config)
    capacity = max(new_width + GROW_MIN, int(new_width * GROW_FACTOR))
    for li, (layer, old) in enumerate(zip(out.layers, cache.layers)):
        views, buffers = {}, {}
        for name, t in _layer_tensors(old).items():
            dim = SEQ_DIM[name]
            rows = t.shape[0]
            shape = list(t.shape)
            shape[0] = rows + len(kvs)
            shape[dim % t.dim()] = capacity
            # Written once: each row's left padding zeroed (the mask hides it, but a NaN there would
            # reach real rows as 0 * NaN), its KV copied; the headroom is written before it is read.
            buf = t.new_empty(shape)
            _seq_slice(buf[:rows], dim, 0, new_width - width).zero_()
            _seq_slice(buf[:rows], dim, new_width - width, new_width).copy_(t)
            for j, kv in enumerate(kvs):
                src, row = kv[li][name], buf[rows + j : rows + j + 1]
                _seq_slice(row, dim, 0, new_width - src.shape[dim]).zero_()
                _seq_slice(row, dim, new_width - src.shape[dim], new_width).copy_(src)
            buffers[name], views[name] = buf, _seq_slice(buf, dim, 0, new_width)
        _set_layer(layer, views, buffers)
    return out


def select_rows(cache: DynamicCache, rows: list[int], drop_left: int) -> None:
    """Keep only `rows` and drop the first `drop_left` columns (padding common to all kept rows)."""
    index = None
    for layer in cache.layers:
        tensors = _layer_tensors(layer)
        kept, buffers = {}, {}
        for name, t in tensors.items():
            dim = SEQ_DIM[name]
            if index is None:
                index = torch.tensor(rows, dtype=torch.long, device=t.device)
            buf = getattr(layer, BUFFERS[name], None)
            if drop_left == 0 and buf is not None:  # keep the headroom: select rows of the buffer
                buffers[name] = buf.index_select(0, index)
                kept[name] = _seq_slice(buffers[name], dim, 0, t.shape[dim])
            else:
                t = t.index_select(0, index)
                kept[name] = _seq_slice(t, dim, drop_left, t.shape[dim])
        _set_layer(layer, kept, buffers if len(buffers) == len(kept) else None)


def decode_mask(pads: list[int], width: int, *, additive_dtype: torch.dtype | None,
                device: torch.device | str = "cpu", window: int | None = None) -> torch.Tensor:
    """[B, 1, 1, width + 1] mask for one new token per row: row i sees columns >= pads[i].

    Boolean (True = attend) for SDPA; additive (0 / dtype min) when `additive_dtype` is given (eager)."""
    cols = torch.arange(width + 1, device=device)
    mask = (cols[None, :] >= torch.tensor(pads, device=device)[:, None])[:, None, None, :]
    if window is not None:  # the new token (column width) sees the last `window` positions, itself included
        mask = mask & (cols > width - window)[None, None, None, :]
    return _as_additive(mask, additive_dtype)


def prefill_mask(pads: list[int], cached: int, new: int, *, additive_dtype: torch.dtype | None,
                 device: torch.device | str = "cpu", window: int | None = None) -> torch.Tensor:
    """[B, 1, new, cached + new] causal mask for `new` query columns after `cached` cache columns.

    Row i's real tokens start at column pads[i] (left padding, as in the decode layout) and run
    contiguously to the last column, so column distance is position distance and `window` can
    be applied by column. A padding query sees only itself: a query that sees nothing gives NaN
    under some SDPA kernels (torch 2.11 on CPU gives 0), and a NaN in a padding column's cached
    K/V would reach every later row through softmax(...) @ V as 0 * NaN."""
    q = torch.arange(new, device=device)[:, None] + cached
    k = torch.arange(cached + new, device=device)[None, :]
    keep = (k <= q) & (k > q - window) if window is not None else (k <= q)
    if not any(pads):  # no padding: one [new, cached + new] mask broadcast over the rows, as before
        return _as_additive(keep[None, None].expand(len(pads), 1, new, cached + new), additive_dtype)
    keep = (keep[None] & (k[None] >= torch.tensor(pads, device=device)[:, None, None])) | (k == q)[None]
    return _as_additive(keep[:, None], additive_dtype)


def _as_additive(mask: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None:
        return mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=mask.device))
