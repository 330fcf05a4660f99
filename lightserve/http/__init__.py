"""The HTTP front: the app (`app.py`), one route module per API dialect, their schemas, SSE streams,
the drain and the front's metrics. Only the launcher imports it; it imports `chat/` and the engine's client."""
