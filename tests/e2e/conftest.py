"""One float32 server for the end-to-end tests of a module; each test module that needs special
flags starts its own."""
from __future__ import annotations

import pytest

from tests.e2e.server import ServerProc


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = ServerProc("--data_type", "float32", "--max_total_token_num", "32768", log_path=log).wait_ready()
    yield srv
    srv.stop()
