"""The embedded CPU engine: SGLang's native HTTP API around a transformers causal LM.

`server` (aiohttp, the HTTP side) -> `scheduler` (one thread owning the model: continuous
batching, prefix cache, pause/retract, weight loads) -> `kv` (per-sequence and batch KV).
Importing this package imports nothing heavy; the modules import torch/transformers.
"""
