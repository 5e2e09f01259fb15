"""The chat REPL and the chat-templated workload on the tiny Llama checkpoint (it has a tokenizer
and a chat template; greedy so the streamed text can be checked against `LLM.generate`)."""

from __future__ import annotations

import io

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tokenspeed_jax import LLM, SamplingParams  # noqa: E402
from tokenspeed_jax.cli.chat import chat_repl  # noqa: E402
from tokenspeed_jax.workloads.agentic import WorkloadConfig, run_workload  # noqa: E402
from tokenspeed_jax.workloads.chat_prompts import ChatPrompts, prompt_source_for  # noqa: E402

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def llm(hf_checkpoints):
    return LLM(hf_checkpoints["llama"][0], page_size=4, num_pages=256, max_batch_requests=4,
               max_scheduled_tokens=64, max_context_len=512, attention_backend="reference")  # fmt: skip


def test_chat_repl_streams_the_greedy_reply_and_keeps_history(llm):
    script = ["Hello there", "The quick brown fox", "/reset", "Mixture of experts", "/exit", "never read"]
    lines = iter(script)
    out = io.StringIO()
    messages = chat_repl(llm, max_tokens=6, temperature=0.0, input_fn=lambda _: next(lines), out=out)
    tok = llm.tokenizer
    first = [{"role": "user", "content": "Hello there"}]
    want = llm.generate([tok.encode(tok.apply_chat_template(first), add_special_tokens=False)],
                        SamplingParams(max_tokens=6))[0]  # fmt: skip
    shown = out.getvalue().split("\n")
    assert shown[0] == want.text  # streamed pieces add up to the final decoded reply
    assert [m["role"] for m in messages] == ["user", "assistant"]  # /reset dropped the first two turns
    assert messages[0]["content"] == "Mixture of experts"
    assert llm.stats()["prefix_hit_tokens"] > 0  # turn 2 re-rendered turn 1: cache hits
    assert next(lines) == "never read"


def test_chat_workload_renders_real_conversations(llm):
    assert isinstance(prompt_source_for(llm.tokenizer), ChatPrompts)
    # the tiny BPE spells the long default system prompt in ~1k tokens: use a short one here
    source = ChatPrompts(llm.tokenizer, system="You are a helpful assistant. Keep answers short.")
    cfg = WorkloadConfig(sessions=3, turns=2, max_tokens=5, ignore_eos=False)
    report = run_workload(llm.engine, cfg, prompts=source)
    assert report.requests == 6 and set(source.replies) == {(s, t) for s in range(3) for t in range(2)}
    convo = source.messages[0]
    assert [m["role"] for m in convo] == ["system", "user", "assistant", "user", "assistant"]
    assert convo[1]["content"] == source.questions[0] and convo[3]["content"] == source.questions[1]
    assert report.prefix_hit_rate > 0.3  # shared system prompt + each session's first turn
    assert prompt_source_for(None) is None
