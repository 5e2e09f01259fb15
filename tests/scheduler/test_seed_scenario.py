"""The seed's aliasing story with page size 4 and literal page ids (DESIGN.md §6).

Tokens: page 0 = [10, 11, 12, 13] ("You are a helpful"). B = page 0 + "assistant . What is",
A = page 0 + "assistant . Hi". B is ahead of A, both run cold in the same step, so B's copy of
page 0 (page 1) becomes the canonical CACHED page and A's private copy is P0 = 4, its second page
P1 = 5. The pool is sized so that P0 is the only page left when A next needs one.
"""

from __future__ import annotations

import numpy as np
import pytest

from scheduler import Scheduler, SchedulerConfig
from scheduler.page_table_oracle import apply_group_ops

CACHED, P0, P1 = 1, 4, 5
PAGE0 = [10, 11, 12, 13]
PROMPT_B = PAGE0 + [14, 15, 20, 21, 22]
PROMPT_A = PAGE0 + [14, 15, 16]


def _run(enable_adoption: bool):
    cfg = SchedulerConfig(
        num_pages=6,
        page_size=4,
        max_batch_requests=4,
        max_scheduled_tokens=64,
        max_context_len=32,
        enable_adoption=enable_adoption,
        debug_checks=True,
    )
    sched = Scheduler(cfg)
    sched.add_request("B", PROMPT_B, 8)
    sched.add_request("A", PROMPT_A, 8)
    tail_only = np.zeros((cfg.num_live_slots, 8), np.int32)
    steps = []
    for _ in range(4):
        ops = sched.schedule()
        apply_group_ops(tail_only, ops, ops.groups[0], honor_full_refresh=False)
        a = ops.row_of("A")
        steps.append(
            dict(
                ops=ops,
                a=a,
                row=sched.get_request("A").tables[0].page_ids(),
                tail_only=tail_only[ops.req_slots[a]].tolist(),
                retractions=sched.stats()["num_retractions"],
            )
        )
        sched.update(ops, np.full(cfg.max_batch_requests, 99, np.int32))
    return sched, steps


def test_adoption_repoints_page0_and_freed_page_returns_as_tail():
    sched, steps = _run(enable_adoption=True)
    assert steps[0]["row"] == [P0, P1]  # A cold: private copy of page 0
    # after step 0, A publishes page 0, finds B's canonical copy and adopts it, freeing P0
    assert steps[1]["row"] == [CACHED, P1]
    assert steps[1]["ops"].full_refresh[steps[1]["a"]]  # first decode after prefill
    # A's next page is the freed P0: the authoritative row is [CACHED, P1, P0]
    assert steps[2]["row"] == [CACHED, P1, P0]
    ops, a = steps[2]["ops"], steps[2]["a"]
    assert not ops.full_refresh[a]  # pure decode: tail delta only
    assert (ops.groups[0].begins[a], ops.groups[0].sizes[a]) == (2, 1)
    assert ops.groups[0].new_pages[a, 0] == P0
    # a tail-only mirror aliases logical pages 0 and 2 onto P0
    assert steps[2]["tail_only"][:3] == [P0, P1, P0]
    assert sched.stats()["adopted_pages"] == 1


def test_retraction_resume_rebuilds_row_with_full_refresh():
    sched, steps = _run(enable_adoption=False)
    assert steps[1]["row"] == [P0, P1] and steps[1]["retractions"] == 0
    # step 2: A needs a page, none is free: A (the newest) is retracted, gives P1, P0 back
    # (deepest first) and resumes at once through a prefix match that finds CACHED for page 0
    # and its own published P1 for page 1; its new tail is P0
    s = steps[2]
    assert s["retractions"] == 1
    assert s["row"] == [CACHED, P1, P0]
    ops, a = s["ops"], s["a"]
    assert ops.full_refresh[a]
    g = ops.groups[0]
    assert g.rows[a, : g.row_lens[a]].tolist() == [CACHED, P1, P0]
    assert (g.begins[a], g.sizes[a]) == (2, 1) and g.new_pages[a, 0] == P0
    assert s["tail_only"][:3] == [P0, P1, P0]  # the bug: logical 0 and 2 share P0
    assert ops.kv_lens[a] == 9 and ops.num_query_tokens(a) == 1  # only the last token recomputed


@pytest.mark.parametrize("adopt", [True, False])
def test_debug_mirror_never_diverges_and_everything_is_returned(adopt):
    sched, _ = _run(enable_adoption=adopt)
    while sched.has_unfinished():
        ops = sched.schedule()
        sched.update(ops, np.full(4, 99, np.int32))
    assert sched.stats()["free_pages"] == 5
    assert sched.stats()["tail_only_divergences"] > 0
