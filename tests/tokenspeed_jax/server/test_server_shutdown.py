"""SIGTERM while 16 streams run, against a real `tokenspeed-jax serve --model tiny-random`
subprocess: the server stops admitting (503 in an OpenAI error body, /health 503 "draining"),
every stream ends cleanly (its choice finishes "length" within the grace or "abort" after it,
then `[DONE]`), and the process exits with status 0. Every wait is bounded.

The engine flags are test_openai.py's configuration, so in a full run the subprocess reads its
compiled shapes back from the session's compilation cache.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from tests.tokenspeed_jax.server.live import free_port  # noqa: E402

GRACE_S = 1.5
MAX_TOKENS = 200
ENGINE = [
    "--model",
    "tiny-random",
    "--page-size",
    "8",
    "--num-pages",
    "300",
    "--max-batch-requests",
    "8",
    "--max-scheduled-tokens",
    "32",
    "--max-context-len",
    "256",
]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited during start-up"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError("server did not become ready")


def _stream(url: str, i: int, opened: list, first_token: threading.Event) -> list:
    """The `data:` payloads of one streamed completion (JSON objects, then "[DONE]"); `opened`
    gains an entry once the server has queued it (its 200 came), `first_token` is set by the
    first token of any stream."""
    out: list = []
    body = {
        "prompt": f"Hello {i}",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        opened.append(i)
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                out.append(data if data == "[DONE]" else json.loads(data))
                if data != "[DONE]" and out[-1]["choices"][0]["token_ids"]:
                    first_token.set()
    return out


def test_sigterm_drains_streams_and_exits_0(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 - read back on failure
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenspeed_jax.cli",
            "serve",
            *ENGINE,
            "--port",
            str(port),
            "--shutdown-grace-s",
            str(GRACE_S),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        _wait_ready(url, proc)
        first_token, opened = threading.Event(), []
        with ThreadPoolExecutor(16) as pool:
            streams = [pool.submit(_stream, url, i, opened, first_token) for i in range(16)]
            deadline = time.monotonic() + 60
            while len(opened) < 16 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert first_token.wait(60) and len(opened) == 16
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            # draining: still listening, but refusing new work and failing its health check
            health = httpx.get(f"{url}/health", timeout=10)
            late = httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
            results = [f.result(timeout=60) for f in streams]
        rc = proc.wait(timeout=60)
        exit_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log.seek(0)
    output = log.read()
    assert rc == 0, output
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    assert late.status_code == 503 and late.headers.get("retry-after")
    err = late.json()["error"]
    assert err["code"] == "server_shutting_down" and err["type"] and "param" in err
    for events in results:  # every stream ends cleanly: one finish reason, then [DONE]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [e["choices"][0] for e in events[:-1]]
        ends = [c["finish_reason"] for c in chunks if c["finish_reason"] is not None]
        assert len(ends) == 1 and ends[0] in ("length", "abort"), ends
        tokens = sum(len(c["token_ids"]) for c in chunks)
        assert tokens == MAX_TOKENS if ends[0] == "length" else tokens <= MAX_TOKENS
    # the grace, the handlers' abort wait and the flush bound the shutdown (no hang)
    assert exit_s < GRACE_S + 30, output
    assert "Traceback" not in output, output
