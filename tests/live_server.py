"""`dlmrt serve` on a real loopback socket: its app in uvicorn in a thread, under the transport's limits,
or the command as its own process."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
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


@contextlib.contextmanager
def dlmrt_serve(*options: str):
    """`dlmrt serve` (tiny model, eager) as its own process on a free loopback port, once /health answers:
    (the process, its port). Killed at the end if still running."""
    import httpx

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "dlmrt.cli", "serve", "--mode", "eager", "--port", str(port),
                               "--log-level", "warning", *options], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).raise_for_status()
                break
            except httpx.TransportError:
                assert server.poll() is None and time.monotonic() < deadline, server.stdout.read().decode()[-2000:]
                time.sleep(0.2)
        yield server, port
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@contextlib.contextmanager
def dlmrt_serve_replicas(*options: str, ready_s: float = 240):
    """`dlmrt serve --replicas ...` (tiny model, eager) as its own process, in a session of its own with the Ray
    cluster it starts, on a free loopback port, once it prints its address: (the process, its port, the lines
    it has printed, growing). Stopped with SIGTERM at the end if still running, then killed with its whole
    process group (Ray's agents outlive a killed driver)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "dlmrt.cli", "serve", "--mode", "eager", "--port", str(port),
                               "--log-level", "warning", *options], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              env={**os.environ, "NO_COLOR": "1"})
    lines: list[str] = []

    def read():  # as it comes, so that the pipe never fills
        for line in server.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + ready_s
        while not any(re.match(r"dlmrt serve: \d+ replicas? ", line) for line in lines):
            assert server.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        yield server, port, lines
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
