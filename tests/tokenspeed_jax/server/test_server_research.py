"""The research routes (issue 48): /sleep, /wake_up, /is_sleeping (vLLM's), and
/update_weights_from_disk (SGLang's), behind the API key; completions get 503 while asleep;
outputs after a wake and after updating there and back equal the first ones."""

from __future__ import annotations

import os
import types

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from flax import nnx  # noqa: E402

from tests.tokenspeed_jax.server.live import LiveServer  # noqa: E402
from tokenspeed_jax import LLM  # noqa: E402
from tokenspeed_jax.models import registry  # noqa: E402
from tokenspeed_jax.runtime.weight_inputs import hf_tensors  # noqa: E402
from tokenspeed_jax.server.app import build_app  # noqa: E402

KEY = "sk-research-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0}


def _checkpoint(root, seed: int) -> str:
    from safetensors.numpy import save_file

    path = os.path.join(root, f"seed{seed}")
    os.makedirs(path)
    net = registry.load_builtin("tiny-random", seed=seed)[1]
    save_file(hf_tensors(nnx.state(net, nnx.Param)), os.path.join(path, "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    pytest.importorskip("safetensors")
    root = tmp_path_factory.mktemp("ckpt")
    llm = LLM(
        "tiny-random", num_pages=64, page_size=8, max_batch_requests=2, max_scheduled_tokens=32,
        max_context_len=256, min_kv_bucket=256, compile_cache_dir=False,
    )  # fmt: skip
    server = LiveServer(build_app(llm, api_keys=[KEY]))
    server.wait_ready(900)
    yield types.SimpleNamespace(
        url=server.url, llm=llm, seed0=_checkpoint(root, 0), seed1=_checkpoint(root, 1)
    )
    server.stop()


def _post(srv, path, body=None, headers=AUTH, **params):
    return httpx.post(f"{srv.url}{path}", json=body, headers=headers, params=params, timeout=120)


def _complete(srv) -> httpx.Response:
    return _post(srv, "/v1/completions", COMPLETION)


def _text(srv) -> str:
    r = _complete(srv)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("POST", "/sleep", None),
        ("POST", "/wake_up", None),
        ("GET", "/is_sleeping", None),
        ("POST", "/update_weights_from_disk", {"model_path": "/tmp"}),
    ],
)
def test_routes_need_the_key(srv, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.request(method, f"{srv.url}{path}", json=body, headers=headers, timeout=60)
        assert r.status_code == 401, r.text
    assert not srv.llm.is_sleeping


def test_sleep_503_and_wake(srv):
    first = _text(srv)
    r = _post(srv, "/sleep", level=1)
    assert r.status_code == 200 and r.json()["freed_bytes"] > 0, r.text
    assert httpx.get(f"{srv.url}/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
    r = _complete(srv)
    assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
    assert _post(srv, "/sleep", level=3).status_code == 400
    r = _post(srv, "/wake_up")
    assert r.status_code == 200, r.text
    assert httpx.get(f"{srv.url}/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}
    assert _text(srv) == first
    st = httpx.get(f"{srv.url}/stats").json()
    assert st["free_pages"] == st["total_pages"]


def test_update_weights_from_disk(srv):
    first = _text(srv)
    r = _post(srv, "/update_weights_from_disk", {"model_path": srv.seed1, "weight_version": 7})
    assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == 7, r.text
    assert srv.llm.weight_version == 7
    assert _complete(srv).json()["weight_version"] == 7  # on every response
    second = _text(srv)
    assert second != first
    # a bad one: 400, nothing changed
    r = _post(srv, "/update_weights_from_disk", {"model_path": "/no/such/dir"})
    assert r.status_code == 400 and not r.json()["success"]
    assert _post(srv, "/update_weights_from_disk", {"path": srv.seed0}).status_code == 400
    assert _text(srv) == second and srv.llm.weight_version == 7
    r = _post(srv, "/update_weights_from_disk", {"model_path": srv.seed0, "abort_all_requests": True})
    assert r.status_code == 200 and r.json()["weight_version"] == 8
    assert _text(srv) == first
