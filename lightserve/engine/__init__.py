"""The engine seen from the launcher's process: starting and stopping the child processes (`procs.py`, with
the host's tuning), the client that submits requests and reads their deltas, the pipeline's loop thread,
and the bundled model's preparation."""
