"""The embedded engine (CPU, or CUDA beside a GPU trainer): SGLang 0.5.23's native HTTP API around
a transformers causal LM.

`server` (aiohttp, the HTTP side; `validation` parses /generate, `weight_api` the weight
endpoints, `weights` the formats and checks) -> `scheduler` (one thread owning the model:
continuous batching, prefix cache, pause/retract, weight loads) -> `kv` (per-sequence and batch
KV). `nodes` is the multi-node rendezvous of `agentrl engine serve --nnodes`.
Importing this package imports nothing heavy; the modules import torch/transformers.
"""
