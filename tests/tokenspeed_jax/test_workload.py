"""`run_workload`: the agentic workload's prompts do not depend on the order requests finish in
(sync vs overlapped loops, or two engines, compare token for token only if they are the same)."""

from __future__ import annotations

from types import SimpleNamespace

from tokenspeed_jax.outputs import CompletionOutput
from tokenspeed_jax.workloads.agentic import WorkloadConfig, run_workload


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
        return [CompletionOutput(request_id=rid, prompt_token_ids=prompt, token_ids=[7, 8],
                                 finish_reason="stop")]

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
