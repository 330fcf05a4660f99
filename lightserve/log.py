"""Logging: one get_logger(__name__) per module, configured once per process entry."""
from __future__ import annotations

import logging
import sys


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def configure_logging(process_name: str, level: str = "info") -> None:
    """Prefix every line with the process name (e.g. 'router', 'worker-tp1') so interleaved
    output from several processes stays readable."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s.%(msecs)03d %(levelname)s [{process_name}] %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
