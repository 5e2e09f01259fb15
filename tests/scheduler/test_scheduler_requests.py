"""Scheduler request API: validation, ordering, chunking, aborts, StepOps contents."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler import Scheduler, SchedulerConfig


def _sched(**kw):
    cfg = dict(
        num_pages=32,
        page_size=4,
        max_batch_requests=4,
        max_scheduled_tokens=8,
        max_context_len=32,
        debug_checks=True,
    )
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


@pytest.mark.parametrize(
    "args,match",
    [
        (("a", [], 4), "empty prompt"),
        (("a", [1, 2], 0), "max_new_tokens"),
        (("a", [1] * 30, 3), "max_context_len"),
        (("a", [1, -2], 3), "negative token"),
        (("", [1], 3), "request_id"),
    ],
)
def test_bad_requests_raise_and_change_nothing(args, match):
    s = _sched()
    before = s.stats()
    with pytest.raises(ValueError, match=match):
        s.add_request(*args)
    assert s.stats() == before and not s.has_unfinished()


def test_duplicate_id_and_bad_sampling_options():
    s = _sched()
    s.add_request("a", [1, 2], 3)
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request("a", [3], 3)
    for opts, match in [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(bogus=1), "unknown options"),
    ]:
        with pytest.raises(ValueError, match=match):
            s.add_request("b", [1], 3, **opts)
    assert s.stats()["num_waiting"] == 1


def test_request_that_can_never_fit_is_rejected():
    s = _sched(num_pages=4)  # 3 usable pages of 4 tokens
    with pytest.raises(ValueError, match="cache pages even alone"):
        s.add_request("big", list(range(14)), 2)
    s.add_request("ok", list(range(10)), 2)


def test_chunked_prefill_mixed_with_decode_and_stepops_layout():
    s = _sched()
    s.add_request("a", [5, 6, 7], 3)
    ops = s.schedule()
    assert ops.request_ids == ("a",) and ops.num_tokens == 3
    s.update(ops, np.array([9, 0, 0, 0], np.int32))
    s.add_request("b", list(range(20, 32)), 2)  # 12 tokens, budget 8: chunks of 7 and 5
    ops = s.schedule()
    assert ops.request_ids == ("a", "b")
    assert ops.cu_q_lens[:3].tolist() == [0, 1, 8] and ops.cu_q_lens[-1] == 8
    assert ops.token_ids[:8].tolist() == [9, 20, 21, 22, 23, 24, 25, 26]
    assert ops.positions[:8].tolist() == [3, 0, 1, 2, 3, 4, 5, 6]
    assert ops.token_rows.tolist() == [0, 1, 1, 1, 1, 1, 1, 1]
    assert ops.kv_lens[:2].tolist() == [4, 7]
    assert ops.sample_mask[:2].tolist() == [True, False]
    assert ops.full_refresh[:2].tolist() == [True, True]  # a: first decode, b: first chunk
    assert ops.req_slots[2:].tolist() == [-1, -1]
    s.update(ops, np.array([10, 11, 0, 0], np.int32))
    ops = s.schedule()
    assert ops.request_ids == ("a", "b") and ops.num_query_tokens(1) == 5
    assert ops.full_refresh[:2].tolist() == [False, True]  # a: pure decode, b: continuation
    assert ops.sample_mask[:2].tolist() == [True, True]


def test_prompt_logprob_targets_and_no_prefix_hit():
    s = _sched(max_scheduled_tokens=16)
    s.add_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 1)
    ops = s.schedule()
    s.update(ops, np.zeros(4, np.int32))
    s.add_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], 1, prompt_logprobs=True)
    ops = s.schedule()
    assert ops.num_tokens == 9  # the cached prefix is recomputed to get its logprobs
    assert ops.prompt_targets[:9].tolist() == [2, 3, 4, 5, 6, 7, 8, 9, -1]


def test_prefix_hit_recomputes_at_least_the_last_token():
    s = _sched(max_scheduled_tokens=16)
    s.add_request("a", list(range(1, 9)), 1)  # exactly 2 pages
    s.update(s.schedule(), np.zeros(4, np.int32))
    s.add_request("b", list(range(1, 9)), 1)
    ops = s.schedule()
    assert ops.num_tokens == 4 and ops.positions[:4].tolist() == [4, 5, 6, 7]
    assert s.stats()["prefix_hit_tokens"] == 4


def test_abort_returns_pages_and_others_keep_running():
    s = _sched()
    s.add_request("a", [1, 2, 3, 4, 5], 10)
    s.add_request("b", [6, 7], 10)
    ops = s.schedule()
    s.abort("a")
    out = s.update(ops, np.array([1, 1, 0, 0], np.int32))  # a's row is ignored
    assert out == [] and s.get_request("a") is None
    s.abort("a")  # unknown ids are ignored
    finished = []
    while s.has_unfinished():
        finished += s.update(ops := s.schedule(), np.ones(4, np.int32))
    assert [o.request_id for o in finished] == ["b"] and len(finished[0].token_ids) == 10
    assert s.stats()["free_pages"] == 31 and s.stats()["num_aborted"] == 1


def test_stop_token_ends_generation_and_is_last():
    s = _sched()
    s.add_request("a", [1, 2], 10, stop_token_ids=[42])
    outs = []
    tokens = iter([5, 6, 42, 8])
    while s.has_unfinished():
        ops = s.schedule()
        outs += s.update(ops, np.array([next(tokens), 0, 0, 0], np.int32))
    assert outs[0].token_ids == [5, 6, 42] and outs[0].finish_reason == "stop"


def test_prefill_chunk_cap_leaves_budget_for_others():
    s = _sched(max_scheduled_tokens=16, max_prefill_chunk_tokens=5)
    s.add_request("long", list(range(1, 20)), 2)
    s.add_request("short", [7, 8, 9], 2)
    ops = s.schedule()
    assert ops.request_ids == ("long", "short")
    assert [ops.num_query_tokens(i) for i in range(2)] == [5, 3]
    with pytest.raises(ValueError, match="max_prefill_chunk_tokens"):
        SchedulerConfig(num_pages=8, max_prefill_chunk_tokens=0)


@pytest.mark.parametrize("max_new", [1, 3])
def test_decode_reserve_never_blocks_a_request_that_fits_alone(max_new):
    """Regression (issue 13): admission reserved decode_reserve_tokens even when the request can
    generate fewer, while add_request's fit check sized it by prompt + max_new_tokens; a request
    that fit alone then waited forever. Now both agree: min(decode_reserve_tokens, tokens left)."""
    s = Scheduler(
        SchedulerConfig(
            num_pages=11,
            page_size=4,
            max_batch_requests=2,
            max_scheduled_tokens=64,
            max_context_len=64,
            decode_reserve_tokens=8,
            debug_checks=True,
        )
    )
    s.add_request("a", list(range(36 - max_new + 1)), max_new)
    for _ in range(max_new + 1):
        ops = s.schedule()
        assert ops.num_seqs == 1
        out = s.update(ops, np.full(2, 7, np.int32))
        if out:
            break
    assert out and out[0].finish_reason == "length" and len(out[0].token_ids) == max_new
    assert s.stats()["free_pages"] == 10


def test_num_waiting_counts_the_queue_only():
    s = _sched(max_batch_requests=1)
    s.add_request("a", [1, 2], 2)
    s.add_request("b", [3, 4], 2)
    assert s.num_waiting == 2 == s.stats()["num_waiting"]
    s.schedule()  # one row: a runs, b waits
    assert s.num_waiting == 1 == s.stats()["num_waiting"]


def test_state_pages_is_checked_and_bounds_a_request_alone():
    """`state_pages`: an int >= 2 beside a state group and another group, no host tier; a
    request whose state pages alone exceed the state pool is refused, naming that pool."""
    from tests.scheduler.helpers import HYBRID, STATE_HYBRID

    base = dict(num_pages=40, page_size=4, max_batch_requests=4, max_scheduled_tokens=12, max_context_len=48)
    for bad, match in [
        (dict(state_pages=1, groups=STATE_HYBRID), "state_pages must be None or an int >= 2"),
        (dict(state_pages=True, groups=STATE_HYBRID), "state_pages must be None or an int >= 2"),
        (dict(state_pages=8, groups=HYBRID), "needs a recurrent-state group"),
        (dict(state_pages=8, groups=STATE_HYBRID, host_pages=4), "host tier needs one pool"),
    ]:
        with pytest.raises(ValueError, match=match):
            SchedulerConfig(**base, **bad)  # type: ignore[arg-type]
    sched = Scheduler(SchedulerConfig(**base, groups=STATE_HYBRID, state_pages=6))  # type: ignore[arg-type]
    # alone: 1 resume page + 3 pages of a 12-token chunk + 2 edges = 6 state pages > 5
    with pytest.raises(ValueError, match="needs 6 state cache pages even alone, the state pool has 5"):
        sched.add_request("a", list(range(20)), 4)
    assert sched.stats()["state_free_pages"] == 5 and not sched.has_unfinished()
