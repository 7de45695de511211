"""`vkubelet` as a user runs it, against a private state root (the `state` fixture of
conftest.py), for the dev cluster CLI tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

VKUBELET = str(Path(sys.prefix) / "bin" / "vkubelet")


def vkubelet(
    state: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [VKUBELET, *args],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "VKUBELET_STATE_DIR": str(state), **(env or {})},
        check=False,
    )
