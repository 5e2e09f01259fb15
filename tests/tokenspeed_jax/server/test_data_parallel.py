"""`tokenspeed-jax serve --data-parallel-size 2` as a real process (2 forced CPU devices): warm-up
gates /health, the startup line describes the deployment, both replicas serve, and a follow-up
prompt goes to the replica that caches its prefix."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tests.tokenspeed_jax.server.live import free_port  # noqa: E402

pytestmark = pytest.mark.slow  # `pytest -m "not slow"` skips it in the inner loop; CI runs it


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("dp") / "serve.log"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    cmd = [
        sys.executable,
        "-m",
        "tokenspeed_jax.cli",
        "serve",
        "--data-parallel-size",
        "2",
        "--num-pages",
        "120",
        "--page-size",
        "8",
        "--max-batch-requests",
        "4",
        "--max-scheduled-tokens",
        "32",
        "--max-context-len",
        "128",
        "--port",
        str(port),
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
        )
    url = f"http://127.0.0.1:{port}"
    seen = set()
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        try:
            code = httpx.get(f"{url}/health", timeout=2).status_code
            seen.add(code)
            if code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    if proc.poll() is not None:
        pytest.fail(f"serve exited: {log.read_text()[-2000:]}")
    yield url, seen, log
    proc.terminate()
    proc.wait(timeout=20)


def test_two_replicas_both_serve_and_route_by_prefix(dp_server):
    url, seen, log = dp_server
    assert 200 in seen
    line = next(ln for ln in log.read_text().splitlines() if "tokenspeed-jax serving" in ln)
    for key in (
        "model=tiny-random",
        "dtype=float32",
        "replicas=2",
        "pages=119",
        "page_size=8",
        "max_context=128",
        "buckets=[1, 16, 32]",
        "backend=",
    ):
        assert key in line, (key, line)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def ask(prompt: str, n: int = 24):
        return client.completions.create(
            model="tiny-random", prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
        )

    # prompts that share no page (routing then balances by load): 8 at once
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: ask(f"{chr(65 + i) * 8} hello", 48), range(8)))
    assert all(o.choices[0].finish_reason == "length" for o in outs)
    per = httpx.get(f"{url}/stats").json()["replicas"]
    assert all(r["num_generated_tokens"] > 0 for r in per), per  # both replicas served
    # a follow-up sharing a 3-page prefix goes where that prefix is cached
    base = "a shared prefix of three pages worth of bytes!"
    ask(base, 1)
    before = [r["prefix_hit_tokens"] for r in httpx.get(f"{url}/stats").json()["replicas"]]
    for _ in range(3):
        ask(base + " and more", 1)
    after = [r["prefix_hit_tokens"] for r in httpx.get(f"{url}/stats").json()["replicas"]]
    gained = [a - b for a, b in zip(after, before)]
    assert sorted(gained)[0] == 0 and max(gained) >= 3 * 40, gained
