"""The real server (uvicorn, localhost) on the tiny model, driven by the official `openai` client.

One server per module; offline references come from `LLM.generate` before the server owns the
engine. Greedy (temperature 0) everywhere exactness matters.
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
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.tokenspeed_jax.server.live import LiveServer  # noqa: E402
from tokenspeed_jax import LLM, SamplingParams  # noqa: E402
from tokenspeed_jax.server.app import build_app  # noqa: E402

CTX = 256  # one kv bucket (DEFAULT_MIN_KV_BUCKET): few shape keys to compile
N = 40


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
    ref = types.SimpleNamespace()
    ref.greedy = llm.generate("Hello", SamplingParams(max_tokens=N, ignore_eos=True, top_logprobs=20))[0]
    ref.presence = llm.generate("Hello", SamplingParams(max_tokens=N, ignore_eos=True, presence_penalty=1.0))[
        0
    ]
    # hold the warm-up until the test has seen /health answer 503
    engine, gate = llm.engines[0], threading.Event()
    warm = engine.warmup
    engine.warmup = lambda: (gate.wait(60), warm())[1]
    server = LiveServer(build_app(llm))
    first = httpx.get(f"{server.url}/health").status_code
    gate.set()
    deadline = time.time() + 900  # compiling every shape key; slow on a loaded 2-core VM
    while (last := httpx.get(f"{server.url}/health").status_code) != 200 and time.time() < deadline:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    yield types.SimpleNamespace(
        url=server.url, llm=llm, ref=ref, health=(first, last), client=client, tok=llm.tokenizer
    )
    server.stop()


def _stats(srv) -> dict:
    return httpx.get(f"{srv.url}/stats").json()


def _greedy(**kw) -> dict:
    return dict(temperature=0, extra_body={"ignore_eos": True}, **kw)


def test_health_503_until_warm_then_200(srv):
    assert srv.health == (503, 200)
    assert srv.client.models.list().data[0].id == "tiny-random"


def test_completion_equals_generate_with_logprobs(srv):
    r = srv.client.completions.create(
        model="tiny-random", prompt="Hello", max_tokens=8, logprobs=3, **_greedy()
    )
    ch, ref = r.choices[0], srv.ref.greedy
    assert ch.text == srv.tok.decode(ref.token_ids[:8]) and ch.finish_reason == "length"
    lp = ch.logprobs
    assert lp.token_logprobs == pytest.approx(ref.logprobs[:8], abs=1e-5)
    assert len(lp.tokens) == 8 and len(lp.text_offset) == 8 and lp.text_offset[0] == 0
    for j, top in enumerate(lp.top_logprobs):  # the step's log-softmax, top 3
        want: dict = {}
        for i, v in ref.top_logprobs[j][:3]:  # keyed by token text: the likelier one of a clash
            want.setdefault(srv.tok.decode([i]), v)
        assert top == pytest.approx(want, abs=1e-5)
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == len(srv.tok.encode("Hello"))


def test_chat_logprobs_streaming_and_not(srv):
    msgs = [{"role": "user", "content": "hi"}]
    r = srv.client.chat.completions.create(
        model="tiny-random", messages=msgs, max_tokens=5, logprobs=True, top_logprobs=2, **_greedy()
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    chunks = list(
        srv.client.chat.completions.create(
            model="tiny-random",
            messages=msgs,
            max_tokens=5,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            **_greedy(),
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = [
        c for ch in chunks for c in ((ch.choices[0].logprobs.content or []) if ch.choices[0].logprobs else [])
    ]
    # (the two runs may batch differently: equal up to float reduction order)
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("length", [2, 3])
def test_multichar_stop_strings_never_leak(srv, stream, length):
    full = srv.tok.decode(srv.ref.greedy.token_ids)
    starts = [
        i
        for i in range(1, len(full) - length)
        if full[i : i + length].isascii()
        and full[i : i + length].isprintable()
        and full.find(full[i : i + length]) == i
    ]
    assert starts, f"no clean stop string in {full!r}"
    i = starts[0]
    stop = full[i : i + length]
    kw = dict(model="tiny-random", prompt="Hello", max_tokens=N, stop=[stop, "never-seen"], **_greedy())
    if stream:
        chunks = list(srv.client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = chunks[-1].choices[0].finish_reason
    else:
        ch = srv.client.completions.create(**kw).choices[0]
        text, reason = ch.text, ch.finish_reason
    assert text == full[:i] and reason == "stop", (stop, text, full)


def test_n3_distinct_seeded_samples_and_greedy_twins(srv):
    kw = dict(
        model="tiny-random", prompt="Hello there, cache!", max_tokens=12, extra_body={"ignore_eos": True}
    )
    hit_before = _stats(srv)["prefix_hit_tokens"]
    a = srv.client.completions.create(n=3, temperature=1.0, seed=7, **kw)
    b = srv.client.completions.create(n=3, temperature=1.0, seed=7, **kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3  # each sample has its own seed
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]  # ... reproducibly
    # samples 2 and 3 share the first one's prompt pages through the prefix cache
    prompt_len = len(srv.tok.encode("Hello there, cache!"))
    assert _stats(srv)["prefix_hit_tokens"] - hit_before >= 4 * ((prompt_len - 1) // 8 * 8)
    g = srv.client.completions.create(n=3, model="tiny-random", prompt="Hello", max_tokens=10, **_greedy())
    want = srv.tok.decode(srv.ref.greedy.token_ids[:10])
    assert [c.text for c in g.choices] == [want] * 3 and g.usage.completion_tokens == 30


def test_penalties_and_logit_bias_reach_the_device(srv):
    r = srv.client.completions.create(
        model="tiny-random", prompt="Hello", max_tokens=N, presence_penalty=1.0, **_greedy()
    )
    assert r.choices[0].text == srv.tok.decode(srv.ref.presence.token_ids)
    assert srv.ref.presence.token_ids != srv.ref.greedy.token_ids
    (t1, lp1), (t2, lp2) = srv.ref.greedy.top_logprobs[0][:2]
    for margin, want in ((0.05, t2), (-0.05, t1)):
        r = srv.client.completions.create(
            model="tiny-random",
            prompt="Hello",
            max_tokens=1,
            logit_bias={str(t2): lp1 - lp2 + margin},
            **_greedy(),
        )
        assert r.choices[0].model_extra["token_ids"] == [want]


def test_stream_include_usage(srv):
    chunks = list(
        srv.client.completions.create(
            model="tiny-random",
            prompt="Hello",
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            **_greedy(),
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


def test_max_tokens_absent_means_up_to_the_context_limit(srv):
    prompt = "x" * (CTX - 6)
    r = srv.client.completions.create(model="tiny-random", prompt=prompt, **_greedy())
    assert r.usage.prompt_tokens == len(srv.tok.encode(prompt))
    assert r.usage.completion_tokens == CTX - r.usage.prompt_tokens
    assert r.choices[0].finish_reason == "length"
    c = srv.client.chat.completions.create(
        model="tiny-random",
        max_completion_tokens=3,
        messages=[{"role": "user", "content": "hi"}],
        **_greedy(),
    )
    assert c.usage.completion_tokens == 3


def test_chat_prompt_is_render_chat(srv):
    """The chat route's prompt is `render_chat` of the messages (what the REPL and the chat
    workload send too): same usage, same greedy reply as a completion of those ids."""
    from tokenspeed_jax.engine.chat_template import render_chat

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = render_chat(srv.tok, msgs)
    chat = srv.client.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=4, **_greedy())
    plain = srv.client.completions.create(model="tiny-random", prompt=ids, max_tokens=4, **_greedy())
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == plain.choices[0].text


def test_unknown_model_is_404_model_not_found(srv):
    with pytest.raises(openai.NotFoundError) as e:
        srv.client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.code == "model_not_found" and e.value.param == "model"


@pytest.mark.parametrize(
    "body,param",
    [
        ('{"prompt": "x", "max_tokens": ', None),  # malformed JSON
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "x", "temperature": [1]}, "temperature"),
        ({"prompt": "x", "bogus_field": 1}, "bogus_field"),
        ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "temperature": -1}, None),
        ({"prompt": [1, 2, 99999]}, None),
        ({"prompt": "x", "logit_bias": {"1": 500}}, None),
    ],
)
def test_bad_requests_get_openai_shaped_400(srv, body, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{srv.url}/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param and param in err["message"]
    stats = _stats(srv)
    assert stats["free_pages"] == stats["total_pages"]  # nothing leaked


def test_unsupported_fields_are_rejected_naming_the_field(srv):
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.chat.completions.create(
            model="tiny-random",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            functions=[{"name": "f", "parameters": {}}],
        )  # the deprecated spelling of tools
    assert e.value.param == "functions" and "functions" in str(e.value)


def _samples(url) -> dict:
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_metrics_parse_and_move(srv):
    before = _samples(srv.url)
    srv.client.completions.create(model="tiny-random", prompt="Hello", max_tokens=5, **_greedy())
    after = _samples(srv.url)
    assert (
        after[("tokenspeed_generation_tokens_total", ())]
        == before[("tokenspeed_generation_tokens_total", ())] + 5
    )
    assert (
        after[("tokenspeed_time_to_first_token_seconds_count", ())]
        == before[("tokenspeed_time_to_first_token_seconds_count", ())] + 1
    )
    assert (
        after[("tokenspeed_engine_steps_total", (("replica", "0"),))]
        > before[("tokenspeed_engine_steps_total", (("replica", "0"),))]
    )
    names = {k[0] for k in after}
    for name in (
        "tokenspeed_num_requests_running",
        "tokenspeed_num_requests_waiting",
        "tokenspeed_pages_used",
        "tokenspeed_pages_free",
        "tokenspeed_prefix_hit_rate",
        "tokenspeed_retractions_total",
        "tokenspeed_evictions_total",
        "tokenspeed_prefill_tokens_total",
        "tokenspeed_host_hit_tokens_total",
        "tokenspeed_compiles_total",
        "tokenspeed_e2e_request_latency_seconds_bucket",
        "tokenspeed_time_per_output_token_seconds_count",
        "tokenspeed_prompt_tokens_total",
        "tokenspeed_startup_seconds",
        "tokenspeed_step_shapes_ready",
    ):
        assert name in names, name
    # the server warmed up before serving: every shape was compiled or read back, and it took time
    ready = sum(
        after[("tokenspeed_step_shapes_ready", (("replica", "0"), ("source", s)))]
        for s in ("compiled", "loaded")
    )
    assert ready == len(srv.llm.engines[0].runner.shape_keys)
    assert after[("tokenspeed_startup_seconds", (("phase", "warmup"), ("replica", "0")))] > 0


def test_non_streaming_disconnect_frees_pages_within_2s(srv, monkeypatch):
    engine = srv.llm.engines[0]
    step = engine.step

    def slow_step():  # a slow model: the request is surely still running when the client leaves
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    aborted = _stats(srv)["num_aborted"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{srv.url}/v1/completions",
            timeout=0.5,
            json={"prompt": "Hello", "temperature": 0, "ignore_eos": True, "max_tokens": CTX - 24},
        )
    t0 = time.time()
    while time.time() - t0 < 2.0:
        st = _stats(srv)
        if st["num_aborted"] > aborted and st["free_pages"] == st["total_pages"]:
            break
        time.sleep(0.05)
    assert st["num_aborted"] == aborted + 1, "the request was not aborted (finished instead?)"
    assert st["free_pages"] == st["total_pages"] and st["num_running"] == 0


def test_bench_serve_against_the_server_writes_json_and_plots(srv, tmp_path):
    pytest.importorskip("matplotlib")
    from tokenspeed_jax.cli.bench_serve import main as bench_serve

    rc = bench_serve(
        [
            "--url",
            srv.url,
            "--sessions",
            "3",
            "--turns",
            "2",
            "--system-tokens",
            "24",
            "--user-tokens",
            "4",
            "--max-tokens",
            "4",
            "--request-rates",
            "50,inf",
            "--max-concurrency",
            "2",
            "--result-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    result = json.loads((tmp_path / "bench_serve.json").read_text())
    assert [lv["request_rate"] for lv in result["levels"]] == [50.0, "inf"]
    for lv in result["levels"]:
        assert lv["completed"] == 6 and lv["failed"] == 0 and lv["total_output_tokens"] == 24
        assert lv["ttft_ms_p50"] <= lv["ttft_ms_p99"] and lv["goodput"] <= lv["request_throughput"]
        assert lv["tpot_ms_p50"] is not None and lv["itl_ms_p99"] is not None
    assert result["pages_over_time"] and "full" in result["pages_over_time"][0]
    for png in ("latency_vs_load.png", "pages_over_time.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_n2_streaming_with_stop_equals_non_streaming(srv):
    msgs = [{"role": "user", "content": "hi"}]
    full = (
        srv.client.chat.completions.create(model="tiny-random", messages=msgs, max_tokens=30, **_greedy())
        .choices[0]
        .message.content
    )
    starts = [
        i
        for i in range(1, len(full) - 2)
        if full[i : i + 2].isascii() and full[i : i + 2].isprintable() and full.find(full[i : i + 2]) == i
    ]
    assert starts, f"no clean stop string in {full!r}: pick another prompt for this test"
    stop = full[starts[0] : starts[0] + 2]
    kw = dict(model="tiny-random", messages=msgs, max_tokens=30, n=2, stop=stop, **_greedy())
    plain = srv.client.chat.completions.create(**kw)
    chunks = list(srv.client.chat.completions.create(stream=True, **kw))
    texts, reasons, roles = {}, {}, set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.delta.role:
                roles.add(ch.index)
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert roles == {0, 1} and reasons == {0: "stop", 1: "stop"}
    assert (
        texts
        == {c.index: c.message.content for c in plain.choices}
        == {0: full[: starts[0]], 1: full[: starts[0]]}
    )
    st = _stats(srv)
    assert st["free_pages"] == st["total_pages"]
