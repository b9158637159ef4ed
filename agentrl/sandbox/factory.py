"""Pick the sandbox backend a config names. Backends are imported only when chosen, so a local
run never imports the Daytona SDK and a Daytona run never needs bubblewrap."""

from __future__ import annotations

from agentrl.config.schema import SandboxConfig
from agentrl.sandbox.base import SandboxProvider


def make_provider(config: SandboxConfig, run_id: str) -> SandboxProvider:
    if config.backend == "local":
        from agentrl.sandbox.local import LocalSandboxProvider

        return LocalSandboxProvider(config, run_id)
    if config.backend == "daytona":
        from agentrl.sandbox.daytona import DaytonaSandboxProvider

        return DaytonaSandboxProvider(config, run_id)
    raise ValueError(f"sandbox.backend = {config.backend!r}: use 'local' or 'daytona'")
