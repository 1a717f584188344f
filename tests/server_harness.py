"""Test harness: the server app on a real uvicorn socket in this process.

Owns: `BackgroundServer`, which runs an app from `build_app` in a daemon thread so a test can
talk to it over loopback and still look at its engine. Refuses: anything a served process
needs; `nanoserve serve` runs uvicorn itself (tests/test_server_crowd.py drives that).
"""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI

from nanoserve.server.app import DRAIN_GRACE_S, start_drain
from nanoserve.server.connections import DEFAULT_HEADER_TIMEOUT_S, with_header_timeout


class BackgroundServer:
    """The app on a real uvicorn socket in a daemon thread.

    `with BackgroundServer(app) as server:` starts it on a free loopback port and waits until
    it accepts connections; `server.base_url` is where. Leaving stops it, draining for at
    most `drain_s`.
    """

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", drain_s: float = 5.0,
                 header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> None:
        self.app = app
        self.host = host
        self.drain_s = drain_s
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning",
                                                    timeout_graceful_shutdown=drain_s + DRAIN_GRACE_S,
                                                    http=with_header_timeout(header_timeout_s)))
        self.thread = threading.Thread(target=self.server.run, name="nanoserve-uvicorn", daemon=True)
        self.base_url = ""

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://{self.host}:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        start_drain(self.app, self.drain_s)
        self.server.should_exit = True
        self.thread.join(timeout=60)
