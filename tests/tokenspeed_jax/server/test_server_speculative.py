"""`serve` with n-gram speculation (issue 24): the real server (uvicorn, localhost) on the tiny
model with cycling weights (tests/tokenspeed_jax/test_speculative.py: most drafts accepted),
driven by the official `openai` client. Greedy text, streamed or not, equals what the engine
without speculation writes; a stop string inside an accepted run cuts the text there; requests
with logprobs still get them; /metrics counts drafts; every page comes back.
"""

from __future__ import annotations

import types

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tests.tokenspeed_jax.server.live import LiveServer  # noqa: E402
from tests.tokenspeed_jax.test_speculative import SPEC, _cycling  # noqa: E402
from tokenspeed_jax import LLM, SamplingParams  # noqa: E402
from tokenspeed_jax.server.app import build_app  # noqa: E402

KW = dict(
    num_pages=400,
    page_size=8,
    max_batch_requests=4,
    max_scheduled_tokens=32,
    max_context_len=256,
    min_kv_bucket=256,
    compile_cache_dir=False,
)
PROMPTS = ["abcabcabcab", "Hello, hello, hello", "1 2 3 1 2 3 1"]


@pytest.fixture(scope="module")
def srv():
    ref = _cycling(LLM("tiny-random", **KW))
    llm = _cycling(LLM("tiny-random", speculative_config=SPEC, **KW))
    server = LiveServer(build_app(llm))
    server.wait_ready(900)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    yield types.SimpleNamespace(url=server.url, ref=ref, client=client)
    server.stop()


def test_greedy_text_equals_plain_engine(srv):
    want = [o.text for o in srv.ref.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))]
    extra = {"ignore_eos": True}
    got = [
        srv.client.completions.create(
            model="tiny-random", prompt=p, max_tokens=40, temperature=0, extra_body=extra
        )
        .choices[0]
        .text
        for p in PROMPTS
    ]
    assert got == want
    streamed = []
    for p in PROMPTS:
        chunks = srv.client.completions.create(
            model="tiny-random", prompt=p, max_tokens=40, temperature=0, stream=True, extra_body=extra
        )
        streamed.append("".join(c.choices[0].text for c in chunks if c.choices))
    assert streamed == want
    # a stop string from the middle of the reference text: the reply ends right before it
    stop = want[0][20:23]
    cut = srv.client.completions.create(
        model="tiny-random", prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop], extra_body=extra
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == want[0][: want[0].index(stop)]
    logp = srv.client.completions.create(
        model="tiny-random", prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=1, extra_body=extra
    ).choices[0]
    assert len(logp.logprobs.token_logprobs) == 12
    metrics = httpx.get(f"{srv.url}/metrics").text
    drafted = [line for line in metrics.splitlines() if line.startswith("tokenspeed_spec_draft_tokens_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0
    st = httpx.get(f"{srv.url}/stats").json()
    assert st["free_pages"] == st["total_pages"] and st["spec_accepted_tokens"] > 0
