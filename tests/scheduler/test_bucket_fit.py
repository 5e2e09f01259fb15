"""Prefill chunks cut to the token buckets (`scheduler.bucket_fit`): new prompts and running
continuations, with the decode rows planned before and after them counted."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given

from scheduler import Scheduler, SchedulerConfig
from scheduler.bucket_fit import fit_chunk

LADDER = (16, 32, 64, 128, 256, 512)


@pytest.mark.parametrize(
    "used,n,after,want",
    [
        (0, 256, 15, 241),  # 15 decodes after a new prompt: 271 -> exactly 256
        (15, 256, 0, 241),  # the same with the decodes planned first
        (0, 256, 0, 256),  # already a bucket
        (0, 400, 0, 400),  # defers 144 > half of 256 saved: stays whole
        (0, 384, 0, 256),  # defers 128 = half: cut
        (250, 10, 10, 10),  # the decodes alone pass the bucket below: nothing to cut
        (0, 600, 0, 600),  # beyond the largest bucket (the runner clamps or rejects elsewhere)
        (0, 12, 0, 12),  # in the smallest bucket
        (10, 1, 10, 1),  # one token is never cut
        (0, 20, 0, 16),  # 20 -> 16, 4 deferred <= 8
        (0, 25, 0, 25),  # 25 -> 16 would defer 9 > 8
    ],
)
def test_fit_chunk_cases(used, n, after, want):
    assert fit_chunk(used, n, after, LADDER) == want


def test_no_buckets_no_cut():
    assert fit_chunk(15, 256, 0, ()) == 256


@given(
    st.integers(0, 600),
    st.integers(1, 600),
    st.integers(0, 64),
    st.lists(st.integers(1, 700), min_size=1, max_size=8, unique=True),
)
def test_fit_chunk_ends_on_a_bucket_or_keeps_the_chunk(used, n, after, buckets):
    buckets = tuple(sorted(buckets))
    got = fit_chunk(used, n, after, buckets)
    assert 1 <= got <= n
    if got < n:
        total = used + got + after
        assert total in buckets
        bigger = min(b for b in buckets if b >= used + n + after)
        assert 2 * (n - got) <= bigger - total  # deferred at most half the padding saved


def _decoding(s: Scheduler, num: int, prompt_len: int = 4) -> None:
    """`num` requests admitted and prefilled: each has one decode row from the next step on."""
    for i in range(num):
        s.add_request(f"d{i}", [100 + i] * prompt_len, 50)
    ops = s.schedule()
    assert ops.num_seqs == num and ops.num_tokens == num * prompt_len
    s.update(ops, np.full(ops.req_slots.shape, 7, np.int32))


def _sched(buckets=LADDER, **kw) -> Scheduler:
    cfg = dict(
        num_pages=400,
        page_size=16,
        max_batch_requests=32,
        max_scheduled_tokens=512,
        max_context_len=1024,
        debug_checks=True,
    )
    cfg.update(kw)
    s = Scheduler(SchedulerConfig(**cfg))
    s.token_buckets = buckets
    return s


def test_new_prompt_beside_15_decodes_is_cut_to_fill_the_256_bucket():
    s = _sched()
    _decoding(s, 15)
    s.add_request("new", list(range(1000, 1256)), 4)
    ops = s.schedule()
    assert ops.num_seqs == 16 and ops.num_tokens == 256
    assert ops.num_query_tokens(15) == 241 and not ops.sample_mask[15]
    s.update(ops, np.full(ops.req_slots.shape, 7, np.int32))
    ops = s.schedule()  # its last 15 tokens ride with the decodes: 30 tokens, the 32 bucket
    assert ops.num_tokens == 30 and ops.num_query_tokens(15) == 15 and ops.sample_mask[15]


def test_without_buckets_the_prompt_goes_whole():
    s = _sched(buckets=())
    _decoding(s, 15)
    s.add_request("new", list(range(1000, 1256)), 4)
    ops = s.schedule()
    assert ops.num_tokens == 271 and ops.num_query_tokens(15) == 256


def test_a_running_prefill_is_cut_with_the_decodes_after_it_counted():
    # "long" is admitted first (chunks of at most 300) and the 15 admitted after it decode
    s = _sched(max_prefill_chunk_tokens=300)
    s.add_request("long", list(range(1, 1001)), 4)
    for i in range(15):
        s.add_request(f"d{i}", [50 + i], 8)
    ops = s.schedule()  # long's 300 cut to 256 before the 15 one-token prompts are known
    assert ops.num_query_tokens(0) == 256 and ops.num_tokens == 271
    s.update(ops, np.full(ops.req_slots.shape, 7, np.int32))
    ops = s.schedule()  # now they are decodes after it: 241 + 15 = the 256 bucket
    assert ops.request_ids[0] == "long" and ops.num_seqs == 16
    assert ops.num_query_tokens(0) == 241 and ops.num_tokens == 256


def test_a_running_prefill_after_the_decodes_is_cut_too():
    s = _sched()
    _decoding(s, 15)
    s.add_request("new", list(range(1000, 1757)), 4)  # 757 = 497 + 260
    ops = s.schedule()
    assert ops.num_tokens == 512 and ops.num_query_tokens(15) == 497
    s.update(ops, np.full(ops.req_slots.shape, 7, np.int32))
    ops = s.schedule()  # 15 + 260 = 275 -> 15 + 241
    assert ops.num_tokens == 256 and ops.num_query_tokens(15) == 241
