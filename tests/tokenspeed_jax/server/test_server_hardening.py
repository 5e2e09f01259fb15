"""Serving hardening through the real server (uvicorn, localhost) on the tiny model: API keys on
every route (streaming included), 400s that name the field the client sent (lone surrogates,
bad sampling values, out-of-vocabulary ids), /tokenize and /detokenize, the body-size (413) and
queue (503 + Retry-After) limits, raw token bytes in chat logprobs.

One server for the module: one key, a 64 KiB body limit, one running request at a time and at
most one waiting (the queue test fills both with long requests).
"""

from __future__ import annotations

import json
import threading
import time
import types

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tests.tokenspeed_jax.server.live import LiveServer  # noqa: E402
from tokenspeed_jax import LLM  # noqa: E402
from tokenspeed_jax.server.app import build_app  # noqa: E402

CTX = 1024  # one kv bucket (min_kv_bucket = CTX): few shape keys to compile
KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def srv():
    llm = LLM(
        "tiny-random",
        num_pages=300,
        page_size=8,
        max_batch_requests=1,
        max_scheduled_tokens=32,
        max_context_len=CTX,
        min_kv_bucket=CTX,
    )
    server = LiveServer(build_app(llm, api_keys=[KEY], max_request_bytes=LIMIT, max_queued_requests=1))
    server.wait_ready(900)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    yield types.SimpleNamespace(url=server.url, llm=llm, client=client, tok=llm.tokenizer)
    server.stop()


def _post(srv, path: str, body, headers=AUTH, **kw) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{srv.url}{path}",
        content=data,
        headers={"Content-Type": "application/json", **headers},
        timeout=60,
        **kw,
    )


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _all_pages_free(srv) -> bool:
    st = httpx.get(f"{srv.url}/stats").json()
    return st["free_pages"] == st["total_pages"]


CHAT = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4}),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "stream": True}),
    ("POST", "/tokenize", {"prompt": "Hello"}),
    ("POST", "/detokenize", {"tokens": [72, 105]}),
]


# ---------------------------------------------------------------------------- API keys
@pytest.mark.parametrize("method,path,body", ROUTES)
def test_api_key_on_every_route(srv, method, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, f"{srv.url}{path}", json=body, headers=headers, timeout=60)
        err = _error(r, 401)
        assert err["code"] == "invalid_api_key" and KEY not in r.text
    r = httpx.request(method, f"{srv.url}{path}", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    if body and body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]")


def test_open_routes_and_openai_client(srv):
    for path in ("/health", "/metrics", "/stats"):
        assert httpx.get(f"{srv.url}{path}").status_code == 200
    bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny-random", messages=CHAT["messages"], max_tokens=2)
    stream = srv.client.chat.completions.create(
        model="tiny-random", messages=CHAT["messages"], max_tokens=4, temperature=0, stream=True
    )
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"


# ---------------------------------------------------------------------------- 400s naming the field
def test_lone_surrogates_are_400_not_500(srv):
    chat = (
        b'{"model": "tiny-random", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    )
    parts = (
        b'{"model": "tiny-random", "max_tokens": 2, "messages": [{"role": "user", '
        b'"content": [{"type": "text", "text": "\\udfff"}]}]}'
    )
    done = b'{"model": "tiny-random", "max_tokens": 2, "prompt": "a\\udc00b"}'
    listed = b'{"model": "tiny-random", "max_tokens": 2, "prompt": ["a\\udc00b"]}'
    stop = b'{"model": "tiny-random", "max_tokens": 3, "prompt": "Hi", "stop": ["x\\ud800"]}'
    one_stop = b'{"model": "tiny-random", "max_tokens": 3, "prompt": "Hi", "stop": "\\ud800"}'
    for path, body, param in [
        ("/v1/chat/completions", chat, "messages"),
        ("/v1/chat/completions", parts, "messages"),
        ("/v1/completions", done, "prompt"),
        ("/v1/completions", listed, "prompt"),
        ("/v1/completions", stop, "stop"),
        ("/v1/completions", one_stop, "stop"),
        ("/tokenize", b'{"prompt": "a\\ud800"}', "prompt"),
    ]:
        err = _error(_post(srv, path, body), 400)
        assert err["param"] == param and "not valid Unicode" in err["message"], (body, err)
    assert _all_pages_free(srv)


@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/v1/completions", {"max_tokens": -5}, "max_tokens"),
        ("/v1/completions", {"temperature": -1}, "temperature"),
        ("/v1/completions", {"top_p": 1.5}, "top_p"),
        ("/v1/completions", {"presence_penalty": 5}, "presence_penalty"),
        ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {"top_k": 0}, "top_k"),
        ("/v1/completions", {"prompt": [72, 100_000]}, "prompt"),
        ("/v1/completions", {"stop_token_ids": [100_000]}, "stop_token_ids"),
        ("/v1/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
        ("/v1/completions", {"max_tokens": CTX}, "max_tokens"),
        ("/v1/chat/completions", {"max_completion_tokens": -1}, "max_completion_tokens"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"temperature": -1}, "temperature"),
    ],
)
def test_validation_errors_name_the_sent_field(srv, path, extra, param):
    base = {"model": "tiny-random", "max_tokens": 2}
    base.update(
        {"prompt": "Hi"}
        if path.endswith("/completions") and "chat" not in path
        else {"messages": CHAT["messages"]}
    )
    err = _error(_post(srv, path, {**base, **extra}), 400)
    assert err["param"] == param and "SamplingParams" not in err["message"], err


# ---------------------------------------------------------------------------- tokenize
def test_tokenize_and_detokenize(srv):
    r = _post(srv, "/tokenize", {"model": "tiny-random", "prompt": "Hé"}).json()
    assert r == {"count": 4, "max_model_len": CTX, "tokens": [256, 72, 195, 169]}
    r = _post(srv, "/tokenize", {"prompt": "Hé", "add_special_tokens": False}).json()
    assert r["tokens"] == [72, 195, 169]
    msgs = {"messages": [{"role": "user", "content": "hi"}]}
    with_prompt = _post(srv, "/tokenize", msgs).json()
    without = _post(srv, "/tokenize", {**msgs, "add_generation_prompt": False}).json()
    assert with_prompt["tokens"] == srv.tok.encode("<|user|>\nhi\n<|assistant|>\n")
    assert without["count"] < with_prompt["count"]
    assert _post(srv, "/detokenize", {"tokens": [72, 195, 169]}).json() == {"prompt": "Hé"}
    assert _error(_post(srv, "/detokenize", {"tokens": [72, 100_000]}), 400)["param"] == "tokens"
    assert _error(_post(srv, "/detokenize", {"tokens": [-1]}), 400)["param"] == "tokens"
    assert _error(_post(srv, "/tokenize", {"prompt": "a", "messages": msgs["messages"]}), 400)
    assert _error(_post(srv, "/tokenize", {"model": "other", "prompt": "a"}), 404)["param"] == "model"


# ---------------------------------------------------------------------------- limits
def test_body_over_limit_is_413_before_parsing(srv):
    big = json.dumps({"model": "tiny-random", "prompt": "x" * LIMIT, "max_tokens": 1}).encode()
    assert _error(_post(srv, "/v1/completions", big), 413)["type"] == "invalid_request_error"

    def chunked():  # no Content-Length: counted as it arrives
        yield big[: LIMIT // 2]
        yield big[LIMIT // 2 :]

    r = httpx.post(
        f"{srv.url}/v1/completions",
        content=chunked(),
        headers={"Content-Type": "application/json", **AUTH},
        timeout=60,
    )
    _error(r, 413)
    ok = {"model": "tiny-random", "prompt": "x" * 100, "max_tokens": 1}
    assert _post(srv, "/v1/completions", ok).status_code == 200


def test_queue_limit_503_at_once_then_the_rest_finish(srv):
    long = {
        "model": "tiny-random",
        "prompt": "Hi",
        "max_tokens": CTX - 8,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    results: dict[int, tuple[int, str]] = {}

    def stream(k: int) -> None:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=long, headers=AUTH, timeout=300) as r:
            results[k] = (r.status_code, r.read().decode())

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(2)]
    threads[0].start()
    deadline = time.time() + 60
    while httpx.get(f"{srv.url}/stats").json()["num_running"] < 1 and time.time() < deadline:
        time.sleep(0.01)
    threads[1].start()  # one running (max_batch_requests=1), this one waits
    while httpx.get(f"{srv.url}/stats").json()["num_waiting"] < 1 and time.time() < deadline:
        time.sleep(0.01)
    t0 = time.time()
    r = _post(srv, "/v1/completions", {"model": "tiny-random", "prompt": "Hi", "max_tokens": 2})
    err = _error(r, 503)
    assert r.headers["retry-after"] == "1" and err["code"] == "server_overloaded"
    assert time.time() - t0 < 5  # at once, not after the queue drained
    for t in threads:
        t.join(300)
    for status, text in results.values():
        assert status == 200 and text.rstrip().endswith("data: [DONE]")
    assert _post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert _all_pages_free(srv)


# ---------------------------------------------------------------------------- logprob bytes
def test_chat_logprob_bytes_are_raw_token_bytes(srv):
    r = srv.client.chat.completions.create(
        model="tiny-random",
        messages=CHAT["messages"],
        max_tokens=24,
        temperature=1.0,
        seed=5,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 24  # every sampled token, EOS or not
    for e in content:
        tid = srv.tok.encode(e.token, add_bos=False) if e.token and "\ufffd" not in e.token else None
        assert len(e.bytes) <= 1  # one byte per token (or none: a special)
        if tid is not None and len(tid) == 1:
            assert e.bytes == tid
        for t in e.top_logprobs:
            assert len(t.bytes) <= 1
    raw = bytes(b for e in content for b in e.bytes)
    assert raw.decode("utf-8", errors="replace") == r.choices[0].message.content
