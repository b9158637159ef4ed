"""`agentrl view RUN_DIR`: a static, self-contained HTML report of a run."""

from agentrl.view.report import render_report, write_report
from agentrl.view.turns import turn_versions

__all__ = ["render_report", "turn_versions", "write_report"]
