"""Running a server in a background thread of this process (tests, notebooks): `with serve_in_thread(...)`."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kiln.errors import KilnError
from kiln.runtime.engine import Engine
from kiln.server.app import ServerConfig, build_app
from kiln.server.drain import DrainingServer


@contextmanager
def serve_in_thread(engine: Engine, config: ServerConfig, host: str = "127.0.0.1", port: int = 0,
                    timeout_s: float = 60.0, drain_s: float | None = None) -> Iterator[str]:
    """Serve `engine` on host:port (0: a free port, bound here so no other process can take it first);
    yields the base URL (http://host:port) and shuts the server down on exit, draining the requests in flight
    for at most drain_s seconds (None: until they finish), as `kiln serve --timeout-graceful-shutdown`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    app = build_app(engine, config)
    server = DrainingServer(app, drain_s, log_level="warning", lifespan="on")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(server.serve(sockets=[sock]))
        except BaseException as e:  # reported to the caller below
            errors.append(e)

    thread = threading.Thread(target=run, name="kiln-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if errors or not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise KilnError(f"the server on {host}:{sock.getsockname()[1]} did not start ({errors[:1]})")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_s)
        sock.close()
