"""Secret hygiene: keys live only in the environment of the process that uses them.

`redact` scrubs the values of known secret variables from any text about to leave the process
(printed plans, logs, error messages); `check_no_secret_keys` refuses config maps (env dicts
passed to engines, env kwargs) that try to carry a secret by name.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

SECRET_ENV_VARS = (
    "DAYTONA_API_KEY",
    "WANDB_API_KEY",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
)
_SECRET_NAME = re.compile(r"(API_KEY|TOKEN|SECRET|PASSWORD)$", re.IGNORECASE)
MASK = "***"
_MIN_SECRET_LEN = 6  # shorter values would redact ordinary words


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    env = os.environ if environ is None else environ
    vals = {env[k] for k in env if (k in SECRET_ENV_VARS or _SECRET_NAME.search(k)) and len(env[k]) >= _MIN_SECRET_LEN}
    return sorted(vals, key=len, reverse=True)


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    for v in secret_values(environ):
        text = text.replace(v, MASK)
    return text


def looks_secret(name: str) -> bool:
    return name in SECRET_ENV_VARS or bool(_SECRET_NAME.search(name))


def check_no_secret_keys(mapping: Mapping[str, object], where: str) -> None:
    bad = [k for k in mapping if looks_secret(k)]
    if bad:
        raise ValueError(
            f"{where} names {', '.join(bad)}: secrets are never config values; export them in the "
            f"environment of the process that needs them (e.g. DAYTONA_API_KEY for episode workers)"
        )


class RedactingFilter(logging.Filter):
    """A logging filter that masks secret values in every record it passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        clean = redact(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        return True
