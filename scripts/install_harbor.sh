#!/usr/bin/env bash
# Installs Harbor (the terminal-bench harness, the `harbor` extra) into .venv next to the openenv
# extra. The two do not resolve together: Harbor 0.26.0 asks for fastmcp>=4.1.6, openenv 0.10.0
# for fastmcp<4. Harbor imports fastmcp only for `harbor serve`, so openenv's versions are put back
# afterwards; `pip check` then reports only Harbor's fastmcp pin. Run after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "install_harbor: .venv is missing; run make setup first" >&2; exit 1; }
if "$PY" -c "import harbor, fastmcp, sys; sys.exit(0 if fastmcp.__version__.startswith('3.') else 1)" 2>/dev/null \
   && "$PY" -m pip show harbor 2>/dev/null | grep -q "^Version: 0.26.0$"; then
  echo "install_harbor: harbor 0.26.0 already installed"
  exit 0
fi
echo "install_harbor: installing harbor 0.26.0 (about a minute)"
"$PY" -m pip install -q "harbor==0.26.0"
"$PY" -m pip install -q fastmcp==3.4.11 fastmcp-slim==3.4.11 mcp==1.30.0 opentelemetry-api==1.45.1
"$PY" -c "import harbor.models.task.config, openenv" && echo "install_harbor: harbor and openenv import"
