"""The one place bench/ reaches into tests/: the fake Daytona cloud (tests/doubles/daytona_standin.py)
that the sandbox benchmark and the faults suite drive the real Daytona SDK against.

tests/ is not an installed package (only agentrl, envs, kernels, launchers and bench are), so its
modules are imported from the repository checkout: the first call puts the repository root on
sys.path (at the end, so nothing installed is shadowed). Nothing happens at import.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def start_daytona_standin(**kwargs: Any) -> tuple[str, Any]:
    """`tests.doubles.daytona_standin.start_standin(**kwargs)`: (DAYTONA_API_URL, handle)."""
    if not (REPO_ROOT / "tests" / "doubles" / "daytona_standin.py").exists():
        raise RuntimeError(f"the Daytona stand-in lives in a repository checkout's tests/doubles/; "
                           f"there is none under {REPO_ROOT}")
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))
    from tests.doubles.daytona_standin import start_standin

    return start_standin(**kwargs)
