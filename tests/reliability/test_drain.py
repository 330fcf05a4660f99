"""Graceful drain with real servers and real signals, through scripts/drain_check.py: one round of
each plan (SIGTERM with a long grace; SIGTERM with a 2 s grace; Ctrl-C to the process group then
SIGTERM), 16 streams and 2 plain requests each. Every request either finishes, or ends visibly with
finish_reason "abort" / a 503; /health says "draining" meanwhile; the launcher exits 0 and leaves
no process, segment or socket file. `python scripts/drain_check.py --rounds 20` is the long run.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "drain_check.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("drain_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["drain_check"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_no_request_cut_silently_across_signals(tmp_path):
    drain_check = _load_script()
    summary = drain_check.main(["--rounds", "3", "--streams", "16", "--log-dir", str(tmp_path), "--quiet"])
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(tmp_path.glob("*.log")))
    assert summary["problems"] == [], (summary, logs)
    assert summary["plans"] == ["drain", "grace", "cut"]
    drained, graced, cut = summary["outcomes_by_round"]
    # A long grace: everything in flight ran to its end.
    assert drained == {"finished": 18}, summary
    # A 2 s grace: the 400-token requests were aborted visibly (the 8-token ones finish in time
    # unless the machine is loaded; either way they end visibly).
    assert graced.get("aborted", 0) >= 9 and set(graced) <= {"finished", "aborted"}, summary
    # Ctrl-C then SIGTERM: aborted at once (the script checks it took far less than the 60 s grace).
    assert cut.get("aborted", 0) >= 8, summary
    assert summary["outcomes"].get("cut", 0) == 0
    assert summary["draining_seen"] == 3, summary


def test_sse_events_split_only_at_line_feeds():
    """Generated text may hold U+2028 or U+0085, which JSON leaves unescaped: still one event each."""
    body = 'data: {"text":"a\u2028b\x85c"}\r\n\ndata: [DONE]\n\n'
    assert _load_script().sse_data(body) == ['{"text":"a\u2028b\x85c"}', "[DONE]"]
