"""Some tests skip when a system tool is missing (a developer machine without root). In CI the
set-up installs them, so there a missing tool is a failure, not a silent skip."""

import os
import shutil

import pytest


@pytest.mark.skipif(not os.environ.get("CI"), reason="only CI promises these tools")
@pytest.mark.parametrize("tool", ["bwrap", "tmux", "chromium"])
def test_ci_has_the_tools_the_suite_needs(tool):
    assert shutil.which(tool), f"{tool} missing: scripts/setup.sh installs it when run as root with apt-get"
