"""Debug knobs read from the environment, all in one place (LIGHTSERVE_ prefix).

Settings belong in ServerConfig; these only switch runtime tweaks off for debugging.
"""
from __future__ import annotations

import os


def no_tcmalloc() -> bool:
    """LIGHTSERVE_NO_TCMALLOC=1: do not preload tcmalloc into CPU worker processes."""
    return os.environ.get("LIGHTSERVE_NO_TCMALLOC", "") not in ("", "0")
