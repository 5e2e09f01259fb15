"""Run the server app with uvicorn on a thread of this process (tests, `bench serve`)."""

from __future__ import annotations

import socket
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """Serves `app` on 127.0.0.1:<free port> until `stop()`; `url` is its base URL."""

    def __init__(self, app, *, port: int | None = None, log_level: str = "warning") -> None:
        import uvicorn

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level=log_level)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="uvicorn")
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Block until /health answers 200 (every replica compiled)."""
        import httpx

        deadline = time.time() + timeout
        while httpx.get(f"{self.url}/health").status_code != 200:
            if time.time() > deadline:
                raise TimeoutError("server did not become ready")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
