"""`run_workload`: the agentic workload's prompts do not depend on the order requests finish in
(sync vs overlapped loops, or two engines, compare token for token only if they are the same).
Also the host pieces it shares with `LLM.generate` and the server, on stand-in engines:
`engine.replicas.Replicas` (routing policies, submit, step_busy, stats) and `render_chat`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenspeed_jax.outputs import CompletionOutput
from tokenspeed_jax.workloads.agentic import WorkloadConfig, WorkloadReport, run_workload


class _OrderedEngine:
    """Finishes one queued request per step, oldest or newest first; replies are fixed."""

    def __init__(self, newest_first: bool) -> None:
        self.newest_first = newest_first
        self.queue: list[tuple[str, list[int]]] = []
        self.prompts: dict[str, list[int]] = {}
        self.num_prefill_tokens = self.num_steps = 0
        self.scheduler = SimpleNamespace(pool=SimpleNamespace(peak_used=0, reset_peak=lambda: None))

    def add_request(self, prompt, params, request_id):
        self.queue.append((request_id, list(prompt)))
        self.prompts[request_id] = list(prompt)
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def step(self) -> list[CompletionOutput]:
        rid, prompt = self.queue.pop(-1 if self.newest_first else 0)
        return [
            CompletionOutput(request_id=rid, prompt_token_ids=prompt, token_ids=[7, 8], finish_reason="stop")
        ]

    def stats(self) -> dict:
        return {"prefix_hit_rate": 0.0, "num_retractions": 0, "total_pages": 1}


def test_follow_up_prompts_do_not_depend_on_the_finish_order():
    cfg = WorkloadConfig(sessions=4, turns=3, system_tokens=5, user_tokens=3, max_tokens=2)
    runs = []
    for newest_first in (False, True):
        eng = _OrderedEngine(newest_first)
        rep = run_workload([eng], cfg, vocab=50)
        assert rep.requests == 12
        runs.append(eng.prompts)
    assert runs[0] == runs[1]
    # turn 1 = turn 0's prompt + its reply + 3 new user tokens
    assert runs[0]["s002-t1"][:10] == runs[0]["s002-t0"] + [7, 8]
    assert len({tuple(p[-3:]) for rid, p in runs[0].items() if rid.endswith("t2")}) == 4


class _FakeReplica:
    """What `Replicas` reads of an engine: load figures, a prefix match, add / step / stats."""

    def __init__(self, match: int = 0, unfinished: int = 0, outstanding: int = 0) -> None:
        self.scheduler = SimpleNamespace(
            num_unfinished=unfinished, prefix_match_tokens=lambda prompt: min(match, len(prompt))
        )
        self.outstanding_tokens = outstanding
        self.added: list = []
        self.steps = 0

    def add_request(self, prompt, params, request_id=None):
        self.added.append((prompt, params, request_id))
        return request_id or f"r{len(self.added)}"

    def has_unfinished(self) -> bool:
        return bool(self.added)

    def step(self) -> list[CompletionOutput]:
        self.steps += 1
        prompt, _, rid = self.added.pop(0)
        return [
            CompletionOutput(
                request_id=rid,
                prompt_token_ids=list(getattr(prompt, "ids", prompt)),
                token_ids=[1],
                finish_reason="length",
            )
        ]

    def stats(self) -> dict:
        return {
            "free_pages": 3,
            "total_pages": 4,
            "prefix_hit_tokens": 1,
            "prefix_query_tokens": 2,
            "async_scheduling": True,
        }


def test_replicas_route_by_the_policy_asked_for():
    from tokenspeed_jax.engine.replicas import Replicas

    # replica 0: longer prefix match but more work; replica 1: idle
    engines = [_FakeReplica(match=8, unfinished=3, outstanding=500), _FakeReplica()]
    prompt = list(range(10))
    assert Replicas(engines, route="prefix").route(prompt) == 0
    assert Replicas(engines, route="load").route(prompt) == 1
    assert Replicas(engines).route(prompt, route="load") == 1  # per-call override
    # ties: prefix -> fewest running + waiting (+ held back), then lowest index; load -> tokens
    even = [_FakeReplica(unfinished=1), _FakeReplica(unfinished=1)]
    assert Replicas(even).route(prompt) == 0
    assert Replicas(even).route(prompt, held=lambda i: [10, 10] if i == 0 else []) == 1
    assert Replicas(even, route="load").route(prompt, held=lambda i: [5] if i == 0 else []) == 1
    assert Replicas(even, route="load").route(prompt) == 0
    with pytest.raises(ValueError, match="route must be one of"):
        Replicas(engines, route="random")
    with pytest.raises(ValueError, match="route must be one of"):
        Replicas([_FakeReplica()]).route(prompt, route="random")  # even with one replica


def test_replicas_submit_step_busy_and_stats():
    from tokenspeed_jax.engine.engine import CheckedPrompt
    from tokenspeed_jax.engine.replicas import Replicas, aggregate_stats
    from tokenspeed_jax.sampling_params import SamplingParams

    a, b = _FakeReplica(outstanding=7), _FakeReplica()
    sp = SamplingParams(max_tokens=2)
    with Replicas([a, b], route="load") as reps:
        checked = CheckedPrompt([1, 2], sp)
        assert reps.submit(checked, sp, "x") == (1, "x")
        assert b.added == [(checked, sp, "x")]  # queued as checked, not re-made
        assert not a.has_unfinished()
        assert [o.request_id for o in reps.step_busy()] == ["x"]  # only the busy replica steps
        assert (a.steps, b.steps) == (0, 1)
        a.added.append(([3], sp, "y"))
        b.added.append(([4], sp, "z"))
        assert [o.request_id for o in reps.step_busy()] == ["y", "z"]  # both, replica order
        assert reps.step_busy() == [] and not reps.has_unfinished()
        st = reps.stats()
    assert st["free_pages"] == 6 and st["total_pages"] == 8 and st["prefix_hit_rate"] == 0.5
    assert st["async_scheduling"] is True and len(st["replicas"]) == 2
    one = a.stats()
    assert aggregate_stats([one]) is one  # one replica: its stats as they are


def test_replicas_request_ids_are_unique_over_replicas():
    """Each engine numbers its own requests; ids that reach a replica through `Replicas` never
    collide with another replica's (the server maps ids back to replicas: a collision let one
    client's finished request abort another client's live one on the other replica)."""
    from tokenspeed_jax.engine.replicas import Replicas
    from tokenspeed_jax.sampling_params import SamplingParams

    a, b = _FakeReplica(), _FakeReplica()
    reps = Replicas([a, b], route="load")
    sp = SamplingParams(max_tokens=2)
    a.outstanding_tokens = 0
    got = []
    for k in range(6):  # alternate the replicas
        a.outstanding_tokens, b.outstanding_tokens = (0, 1) if k % 2 == 0 else (1, 0)
        got.append(reps.submit([1, 2], sp))
    assert [i for i, _ in got] == [0, 1, 0, 1, 0, 1]
    assert len({rid for _, rid in got}) == 6
    assert reps.new_request_id() not in {rid for _, rid in got}


def test_render_chat_encodes_the_template_without_a_second_bos():
    from tokenspeed_jax.engine.chat_template import render_chat
    from tokenspeed_jax.models.byte_tokenizer import BOS_ID, ByteTokenizer

    class Templated:
        chat_template = "{{ bos_token }}..."

        def __init__(self) -> None:
            self.calls: list = []

        def apply_chat_template(self, messages, add_generation_prompt=True):
            return "<s>" + "|".join(m["content"] for m in messages) + ("|>" * add_generation_prompt)

        def encode(self, text, add_special_tokens=True):
            self.calls.append((text, add_special_tokens))
            return [ord(c) for c in text]

    tok = Templated()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert render_chat(tok, msgs) == [ord(c) for c in "<s>be brief|hi|>"]
    assert tok.calls == [("<s>be brief|hi|>", False)]  # the template wrote BOS: add none
    # no template (the built-in byte tokenizer): the plain fallback, BOS added once by encode
    ids = render_chat(ByteTokenizer(), msgs)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert bytes(ids[1:]).decode() == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"


def test_the_summary_shows_a_state_pool_only_where_there_is_one():
    kw = dict(requests=1, prompt_tokens=4, computed_prompt_tokens=4, generated_tokens=2, wall_s=1.0, steps=2,
              ttft_s=[0.1], tpot_s=[0.01], prefix_hit_rate=0.0, retractions=0, peak_pages=3, total_pages=9,
              compiles=1)  # fmt: skip
    assert "state_pages" not in WorkloadReport(**kw).summary()
    summary = WorkloadReport(**kw, state_pages=5).summary()
    assert summary["state_pages"] == 5 and summary["total_pages"] == 9
