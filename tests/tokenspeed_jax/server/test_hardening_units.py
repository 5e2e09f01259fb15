"""Units of the serving hardening without a model: the API-key and body-size middlewares on a
stub app, the queue limit, and raw token bytes in chat logprobs (byte and ByteLevel BPE)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from tokenspeed_jax.models.byte_tokenizer import ByteTokenizer  # noqa: E402
from tokenspeed_jax.server.auth import ApiKeyMiddleware, resolve_keys  # noqa: E402
from tokenspeed_jax.server.choice import ChoiceState, token_bytes  # noqa: E402
from tokenspeed_jax.server.errors import install_error_handlers  # noqa: E402
from tokenspeed_jax.server.limits import BodyLimitMiddleware, queue_full  # noqa: E402


def _stub(require_metrics: bool = False, max_bytes: int = 100) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/metrics")
    def metrics():
        return {"m": 1}

    @app.post("/v1/echo")
    async def echo(http: Request):
        return {"n": len(await http.body())}

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_bytes)
    app.add_middleware(ApiKeyMiddleware, keys=["k1", "k2"], require_key_for_metrics=require_metrics)
    return TestClient(app)


def _is_openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_api_key_missing_wrong_right():
    c = _stub()
    err = _is_openai_error(c.post("/v1/echo", content=b"x"), 401)
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    wrong = c.post("/v1/echo", content=b"x", headers={"Authorization": "Bearer nope-secret"})
    assert "nope-secret" not in _is_openai_error(wrong, 401)["message"]  # never echoed
    _is_openai_error(c.post("/v1/echo", headers={"Authorization": "Basic k1"}), 401)
    _is_openai_error(c.get("/docs", headers={}), 401)  # everything but the open paths
    for key in ("k1", "k2"):
        r = c.post("/v1/echo", content=b"abc", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json() == {"n": 3}
    assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_metrics_require_key():
    c = _stub(require_metrics=True)
    _is_openai_error(c.get("/metrics"), 401)
    assert c.get("/metrics", headers={"Authorization": "Bearer k1"}).status_code == 200
    assert c.get("/health").status_code == 200


def test_resolve_keys_flags_then_env():
    assert resolve_keys(["a", "b"], {"TOKENSPEED_JAX_API_KEY": "e"}) == ["a", "b"]
    assert resolve_keys(None, {"TOKENSPEED_JAX_API_KEY": "e"}) == ["e"]
    assert resolve_keys([], {}) == []


def test_body_limit_declared_and_streamed():
    c, auth = _stub(max_bytes=100), {"Authorization": "Bearer k1"}
    assert c.post("/v1/echo", content=b"x" * 100, headers=auth).json() == {"n": 100}
    err = _is_openai_error(c.post("/v1/echo", content=b"x" * 101, headers=auth), 413)
    assert "100 bytes" in err["message"]

    def chunks():  # no Content-Length: chunked transfer, counted as it arrives
        for _ in range(10):
            yield b"y" * 30

    _is_openai_error(c.post("/v1/echo", content=chunks(), headers=auth), 413)
    assert c.post("/v1/echo", content=iter([b"z" * 50]), headers=auth).json() == {"n": 50}


def test_queue_full():
    assert queue_full([{"num_waiting": 5}], None) is None
    assert queue_full([{"num_waiting": 1}, {"num_waiting": 1}], 3) is None
    r = queue_full([{"num_waiting": 2}, {"num_waiting": 1}], 3)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"


def test_token_bytes_byte_tokenizer_rebuild_split_characters():
    tok = ByteTokenizer()
    ids = tok.encode("é€", add_bos=False)  # 2 + 3 bytes, each a token
    ch = ChoiceState(0, tok, [])
    content = ch.chat_logprobs(ids, [0.0] * len(ids), [[(i, 0.0)] for i in ids])["content"]
    assert [e["bytes"] for e in content] == [[b] for b in "é€".encode()]
    assert bytes(b for e in content for b in e["bytes"]).decode() == "é€"
    assert content[0]["top_logprobs"][0]["bytes"] == [ids[0]]
    assert token_bytes(tok, 257) == []  # EOS: no text, no bytes


def test_token_bytes_bytelevel_bpe():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenspeed_jax.hf.tokenizer import HFTokenizer

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(["hello world", "héllo wörld €€ 日本"] * 20, trainer=trainer)
    tok = HFTokenizer(bpe)
    text = "héllo 漢字 €"  # 漢字 unseen in training: one token per byte
    ids = tok.encode(text, add_special_tokens=False)
    got = [token_bytes(tok, t) for t in ids]
    assert bytes(b for bs in got for b in bs).decode() == text
    # pieces of a multi-byte character decode to U+FFFD; their bytes are the raw byte(s)
    split = [(t, bs) for t, bs in zip(ids, got) if "\ufffd" in tok.decode([t])]
    assert split
    for _, bs in split:
        assert bs != list("\ufffd".encode()) and all(b >= 0x80 for b in bs)
