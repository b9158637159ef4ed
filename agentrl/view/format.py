"""Formatting shared by the report's sections. `esc` is the one way text enters the page."""

from __future__ import annotations

from html import escape
from typing import Any


def esc(text: object) -> str:
    """HTML-escape anything (quotes too, so it is safe inside attributes)."""
    return escape(str(text), quote=True)


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "\u2013"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return esc(value)
    if digits == 0:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def fmt_duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "\u2013"
    s = int(seconds)
    return f"{s // 3600}h {s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m {s % 60:02d}s"


def outcome_class(row: dict[str, Any]) -> str:
    outcome = str(row.get("outcome", ""))
    if outcome.startswith("infra_error"):
        return "infra"
    if outcome in ("agent_timeout", "truncated"):
        return "limit"
    reward = row.get("reward")
    return "pass" if isinstance(reward, (int, float)) and reward >= 1.0 else "fail"


def cut(text: str, limit: int) -> str:
    """At most `limit` characters: the head and the tail (errors tend to be at the end)."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    return f"{text[:head]}\n[... {len(text) - limit:,} characters not shown ...]\n{text[len(text) - (limit - head) :]}"
