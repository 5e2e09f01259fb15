"""Request lifecycle through the real server (uvicorn, localhost) on the tiny model: the request
timeout (504 / a final error event, pages back), one request's failure kept its own (the
tokenizer raising on one prompt or on one request's output, the stepping thread failing one
request, a failing on_finish), and the queue-time histogram.

One server for the module, with `request_timeout_s=TIMEOUT`. Its engine's step can be slowed
(`srv.slow`): a slowed request cannot finish within the timeout whatever the machine's speed
(200 tokens at >= 0.1 s a step: >= 20 s), so nothing here depends on how fast the host is. Greedy
requests with a +100 logit_bias on one token generate only that token: the "bad" request's token
(`BAD`) is the one the patched tokenizer / engine refuse, the good ones' (`GOOD`) never is.
"""

from __future__ import annotations

import json
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from tests.tokenspeed_jax.server.live import LiveServer  # noqa: E402
from tokenspeed_jax import LLM  # noqa: E402
from tokenspeed_jax.server.app import build_app  # noqa: E402

CTX = 256  # the config of test_openai.py: its compiled shapes are read back from the cache
TIMEOUT = 10.0  # >> a 4-token request's steps (and a shape compile) on a loaded host
BAD, GOOD = ord("Z"), ord("a")


@pytest.fixture(scope="module")
def srv():
    llm = LLM(
        "tiny-random",
        num_pages=300,
        page_size=8,
        max_batch_requests=8,
        max_scheduled_tokens=32,
        max_context_len=CTX,
    )
    engine, slow = llm.engines[0], threading.Event()
    step = engine.step

    def maybe_slow_step():
        if slow.is_set():
            time.sleep(0.1)
        return step()

    engine.step = maybe_slow_step
    app = build_app(llm, request_timeout_s=TIMEOUT)
    server = LiveServer(app)
    server.wait_ready(900)
    yield types.SimpleNamespace(url=server.url, llm=llm, app=app, slow=slow, tok=llm.tokenizer)
    slow.clear()
    server.stop()


def _post(srv, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, timeout=60)


def _forced(token: int, max_tokens: int = 4, **more) -> dict:
    return {
        "prompt": "Hello",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": {str(token): 100},
        **more,
    }


def _stream(srv, body: dict, path: str = "/v1/completions") -> list:
    """Every `data:` payload of a streamed request (JSON objects, then "[DONE]")."""
    out = []
    with httpx.stream("POST", f"{srv.url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _pages_back(srv, within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        st = httpx.get(f"{srv.url}/stats").json()
        if st["free_pages"] == st["total_pages"] and st["num_running"] == 0 and st["num_waiting"] == 0:
            return True
        time.sleep(0.05)
    return False


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _good_text(r: httpx.Response, n: int = 4) -> None:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == [GOOD] * n and choice["finish_reason"] == "length"


# ---------------------------------------------------------------------------- timeout
def test_request_timeout_non_streaming_and_streaming(srv):
    srv.slow.set()
    try:
        with ThreadPoolExecutor(2) as pool:
            whole = pool.submit(_post, srv, _forced(GOOD, max_tokens=200))
            streamed = pool.submit(_stream, srv, _forced(GOOD, max_tokens=200))
            r, events = whole.result(timeout=60), streamed.result(timeout=60)
    finally:
        srv.slow.clear()
    err = _error(r, 504)
    assert err["code"] == "request_timeout" and err["type"] == "timeout_error"
    assert "--request-timeout-s" in err["message"]
    # streamed: the tokens so far, then one error event, then [DONE]
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
    assert all("choices" in e and e["choices"][0]["finish_reason"] is None for e in events[:-2])
    assert _pages_back(srv)
    metrics = httpx.get(f"{srv.url}/metrics").text
    assert 'tokenspeed_requests_finished_total{finish_reason="timeout"} 2.0' in metrics
    _good_text(_post(srv, _forced(GOOD)))  # and the server goes on


# ---------------------------------------------------------------------------- isolation
def test_tokenizer_failing_on_one_prompt_fails_that_request_only(srv, monkeypatch):
    encode = srv.tok.encode

    def flaky(text, *a, **kw):
        if "BOOM" in text:
            raise RuntimeError("tokenizer exploded")
        return encode(text, *a, **kw)

    monkeypatch.setattr(srv.tok, "encode", flaky)
    with ThreadPoolExecutor(4) as pool:
        good = [pool.submit(_post, srv, _forced(GOOD)) for _ in range(3)]
        bad = _post(srv, {**_forced(GOOD), "prompt": "BOOM"})
        chat = _post(
            srv, {"messages": [{"role": "user", "content": "BOOM"}], "max_tokens": 2}, "/v1/chat/completions"
        )
        for f in good:
            _good_text(f.result(timeout=60))
    assert _error(bad, 400)["param"] == "prompt" and "exploded" in bad.json()["error"]["message"]
    assert _error(chat, 400)["param"] == "messages"
    assert _pages_back(srv)


def test_tokenizer_failing_on_one_output_fails_that_request_only(srv, monkeypatch):
    decode = srv.tok.decode

    def flaky(ids, *a, **kw):
        if BAD in list(ids):
            raise RuntimeError("cannot decode")
        return decode(ids, *a, **kw)

    monkeypatch.setattr(srv.tok, "decode", flaky)
    srv.slow.set()  # the bad requests cannot reach their end before their handlers drop them
    try:
        with ThreadPoolExecutor(4) as pool:
            good = [pool.submit(_post, srv, _forced(GOOD)) for _ in range(2)]
            streamed = pool.submit(_stream, srv, _forced(BAD, max_tokens=200))
            bad = _post(srv, _forced(BAD, max_tokens=200))
            events = streamed.result(timeout=60)
            for f in good:
                _good_text(f.result(timeout=60))
    finally:
        srv.slow.clear()
    err = _error(bad, 422)
    assert err["code"] == "request_failed" and "cannot decode" in err["message"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_failed"
    assert _pages_back(srv)
    _good_text(_post(srv, _forced(GOOD)))


def test_stepping_thread_failing_one_request_fails_it_alone(srv, monkeypatch):
    engine = srv.llm.engines[0]
    stream = engine.stream

    def flaky(rid, start=0):
        state = stream(rid, start)
        if state is not None and BAD in state.token_ids:
            raise RuntimeError("stream broke")
        return state

    monkeypatch.setattr(engine, "stream", flaky)
    srv.slow.set()
    try:
        with ThreadPoolExecutor(3) as pool:
            good = [pool.submit(_post, srv, _forced(GOOD)) for _ in range(2)]
            bad = _post(srv, _forced(BAD, max_tokens=200))
            for f in good:
                _good_text(f.result(timeout=60))
    finally:
        srv.slow.clear()
    err = _error(bad, 422)
    assert err["code"] == "request_failed" and "stream broke" in err["message"]
    assert _pages_back(srv)


def test_failing_on_finish_callback_loses_nothing(srv, monkeypatch):
    async_engine = srv.app.state.engine
    on_finish = async_engine._on_finish

    def flaky(out):
        if BAD in out.token_ids:
            raise RuntimeError("metrics broke")
        on_finish(out)

    monkeypatch.setattr(async_engine, "_on_finish", flaky)
    with ThreadPoolExecutor(3) as pool:
        rs = [pool.submit(_post, srv, _forced(tok)) for tok in (BAD, GOOD, GOOD)]
        bad, *good = [f.result(timeout=60) for f in rs]
    assert bad.status_code == 200 and bad.json()["choices"][0]["token_ids"] == [BAD] * 4
    for r in good:
        _good_text(r)
    _good_text(_post(srv, _forced(GOOD)))  # the stepping thread is alive
    assert _pages_back(srv)


# ---------------------------------------------------------------------------- metrics
def test_queue_time_in_metrics(srv):
    def count() -> float:
        for line in httpx.get(f"{srv.url}/metrics").text.splitlines():
            if line.startswith("tokenspeed_queue_time_seconds_count"):
                return float(line.split()[-1])
        raise AssertionError("tokenspeed_queue_time_seconds missing from /metrics")

    before = count()
    _good_text(_post(srv, {**_forced(GOOD), "n": 2}))
    assert count() == before + 2  # one observation per sample
