"""`dlmrt serve`'s app on a real loopback socket: uvicorn in a thread, under the transport's limits."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from dlmrt.serve.app import ServerLimits
from dlmrt.serve.transport import server_config


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LiveServer:
    """uvicorn serving `app` on a free loopback port, in a thread, as `dlmrt serve` configures it."""

    def __init__(self, app, limits: ServerLimits = ServerLimits()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(server_config(app, limits, host="127.0.0.1", port=self.port,
                                                   log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        return self

    def shutdown(self):
        self.server.should_exit = True  # what uvicorn's SIGTERM handler does
        self.thread.join(60)

    def __exit__(self, *exc):
        self.shutdown()
