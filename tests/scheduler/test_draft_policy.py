"""The speculative draft policies (issue 44): which token bucket a speculative step takes.

The host knows every row's n-gram proposal before it builds the step, so the default "cost"
policy (`speculative.choose_drafts`) keeps a step whose rows propose nothing in the bucket its
one-token rows need (the 1-token bucket of a lone decode on CPU) and moves to a bigger bucket
only when the expected accepted drafts pay for its measured cost. Checked here on the pure
function (literal expected counts and the break-even point on both sides), on its estimators
(`AcceptanceModel`, `StepCosts`) and through `Scheduler.schedule` / `update` (the StepOps token
count, the shadow check of proposals that were not drafted).
"""

from __future__ import annotations

import numpy as np
import pytest

from scheduler import Scheduler, SchedulerConfig
from scheduler.speculative import AcceptanceModel, SpeculativeConfig, StepCosts, choose_drafts

COST = SpeculativeConfig(num_speculative_tokens=15)
LADDER = (1, 16, 32, 64)


def _costs(**seconds: float) -> StepCosts:
    """StepCosts with bucket b timed at seconds["b<b>"]."""
    costs = StepCosts()
    for key, s in seconds.items():
        costs.observe(int(key[1:]), s)
    return costs


def test_no_proposal_no_drafts():
    """Rows that propose nothing carry nothing, whatever the policy: the step stays in the
    bucket of its one-token rows (a lone decode: the 1-token bucket)."""
    for policy in ("cost", "padding", "always"):
        spec = SpeculativeConfig(draft_policy=policy)
        assert choose_drafts(spec, [], 1, LADDER, 8) == []
        assert choose_drafts(spec, [(0, 3), (0, 0)], 2, LADDER, 8) == [0, 0]


def test_lone_row_drafts_only_when_they_pay():
    """Batch 1 on (1, 16, ...): 16 costs c16 / c1 times a lone decode, so d drafts go iff
    1 + E[accepted] > c16 / c1. E[accepted] = the sum of `gains`; both sides of the point."""
    model = AcceptanceModel()
    for run, n in ((0, 1), (0, 4), (4, 15), (2, 7)):
        gain = sum(model.gains(run, n))
        below = _costs(b1=1.0, b16=1.0 + gain * 0.98)  # 16 pays
        above = _costs(b1=1.0, b16=1.0 + gain * 1.02)  # 16 costs more than it brings
        assert choose_drafts(COST, [(n, run)], 1, LADDER, 8, below, model) == [n]
        assert choose_drafts(COST, [(n, run)], 1, LADDER, 8, above, model) == [0]
    # a long run of right proposals pays for 16 at 2.5x; a lone first guess does not
    costs = _costs(b1=1.0, b16=2.5)
    assert choose_drafts(COST, [(15, 4)], 1, LADDER, 8, costs, model) == [15]
    assert choose_drafts(COST, [(1, 0)], 1, LADDER, 8, costs, model) == [0]


def test_free_padding_goes_to_the_best_rows_first():
    """8 rows in bucket 16 (32 far too dear): the 8 padding tokens are free, taken by the
    drafts of highest marginal gain: row 0 (run 4, q = 0.9) before the first guesses of the
    others (q = 0.5 each, earlier rows first)."""
    costs = _costs(b1=1.0, b16=2.0, b32=100.0)
    rows = [(4, 4)] + [(4, 0)] * 7
    assert choose_drafts(COST, rows, 8, LADDER, 8, costs) == [4, 1, 1, 1, 1, 0, 0, 0]
    # 32 nearly as cheap as 16: worth it; its 24 padding tokens drop each row's least likely
    # draft, the last row's two (64 would hold every draft, at 2.1 * 80 / 48 by the guess: not worth it)
    cheap = _costs(b1=1.0, b16=2.0, b32=2.1)
    assert choose_drafts(COST, rows, 8, LADDER, 8, cheap) == [4] + [3] * 6 + [2]
    # 16 rows fill bucket 16: drafts need 32, a 1.6x step for 16 rows -> not worth it here
    assert choose_drafts(COST, [(4, 0)] * 16, 16, LADDER, 16, _costs(b16=2.0, b32=3.2)) == [0] * 16


def test_acceptance_model_learns_per_run():
    model = AcceptanceModel()
    assert model.q(0) == pytest.approx(AcceptanceModel.PRIOR[0])
    assert model.q(99) == model.q(AcceptanceModel.BINS - 1)
    g = model.gains(1, 3)  # drafts move the run up: q(1), q(1) q(2), q(1) q(2) q(3)
    assert g == pytest.approx([model.q(1), model.q(1) * model.q(2), model.q(1) * model.q(2) * model.q(3)])
    for _ in range(50):  # at run 0, first guesses always wrong
        model.observe(0, 0, True)
    assert model.q(0) < 0.05 and model.q(1) == pytest.approx(AcceptanceModel.PRIOR[1])
    before = model.tries[:]
    model.observe(1, 2, True)  # right at runs 1 and 2, wrong at run 3
    assert [t - b for t, b in zip(model.tries, before)] == [0, 1, 1, 1, 0]
    model.observe(4, 3, False)  # the tokens ran out before a miss: three hits in the top bin
    assert model.tries[4] - before[4] == 3
    for _ in range(1000):  # counts are halved past MAX_TRIES: the model keeps following
        model.observe(0, 1, False)
    assert model.tries[0] <= AcceptanceModel.MAX_TRIES and model.q(0) > 0.9


def test_step_costs():
    costs = StepCosts(window=3, stale=4)
    assert costs.cost(16) / costs.cost(1) == pytest.approx(32 / 17)  # untimed: the guess
    costs.observe(1, 2.0)
    assert costs.cost(16) == pytest.approx(2.0 * 32 / 17)  # scaled from the timed bucket
    for s in (9.0, 1.0, 1.2, 1.1):  # the median of the last 3: one slow step is ignored
        costs.observe(1, s)
    assert costs.cost(1) == pytest.approx(1.1)
    costs.observe(16, 50.0)  # timed slow once
    assert costs.cost(16) == 50.0
    for _ in range(5):
        costs.observe(1, 1.0)
    assert 16 not in costs.measured()  # not timed for `stale` steps: forgotten, guessed again
    assert costs.cost(16) == pytest.approx(32 / 17)


def _sched(**spec) -> Scheduler:
    """A speculative scheduler on a CPU runner's ladder. Prompts below are 16 tokens, one
    bucket exactly (`fit_chunk` cuts others to a bucket's edge first)."""
    cfg = SchedulerConfig(
        num_pages=32,
        page_size=4,
        max_batch_requests=2,
        max_scheduled_tokens=32,
        max_context_len=64,
        debug_checks=True,
        speculative={"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, **spec},
    )
    sched = Scheduler(cfg)
    sched.token_buckets = (1, 16, 32)  # a CPU runner's ladder (the engine sets it)
    return sched


def _step(sched, sampled, accepted=None):
    ops = sched.schedule()
    sched.update(
        ops,
        np.array([sampled, -1], np.int32),
        None if accepted is None else np.array([accepted, 0], np.int32),
    )
    return ops


def test_scheduler_buckets_follow_the_proposals():
    """Through schedule / update: no proposal -> a 1-token step; a proposal whose drafts pay
    -> a row of 1 + d tokens; the same proposal when 16 costs too much -> 1 token, but the
    proposal is still checked against the token the row got (the run and the model learn)."""
    sched = _sched()
    sched.add_request("a", list(range(20, 28)) + [1, 2, 3, 4, 5, 6, 7, 8], 30)
    req = sched.get_request("a")
    _step(sched, 9)  # prefill; tokens ... 8 9: nothing recurs
    ops = _step(sched, 1)
    assert ops.num_tokens == 1 and req.spec_run == 0
    # tokens ... 9 1: "1" recurs -> proposal [2, 3, 4, 5]; costs untimed (the guess: 16 is
    # 1.9x 1) and E[accepted] = 1.38 at run 0: worth it
    ops = sched.schedule()
    assert ops.num_tokens == 5 and ops.draft_lens[0] == 4
    assert ops.token_ids[:5].tolist() == [1, 2, 3, 4, 5]
    sched.update(ops, np.array([6, -1], np.int32), np.array([4, 0], np.int32))  # all right
    assert req.tokens[-5:] == [2, 3, 4, 5, 6] and req.spec_run == 4
    # now 16 costs 9x a lone decode: the proposal [7, 8, 9, 1] stays on the host
    sched.step_costs = _costs(b1=1.0, b16=9.0)
    tries = sched.spec_model.tries[:]
    ops = _step(sched, 7)
    assert ops.num_tokens == 1 and ops.draft_lens[0] == 0
    assert req.spec_run == 5 and sched.spec_model.tries[4] == tries[4] + 1
    ops = _step(sched, 42)  # proposal [8, 9, 1, 2]: wrong at once
    assert ops.num_tokens == 1 and req.spec_run == 0
    assert sched.stats()["spec_draft_tokens"] == 4


def test_rejected_drafts_reset_the_run():
    sched = _sched()
    sched.add_request("a", list(range(20, 29)) + [1, 2, 3, 4, 1, 2, 3], 30)
    req = sched.get_request("a")
    _step(sched, 4)  # prefill; tokens 1 2 3 4 1 2 3 4 -> proposal [1, 2, 3, 4]
    ops = _step(sched, 7, accepted=2)  # 1, 2 accepted, then 7 instead of 3
    assert ops.draft_lens[0] == 4 and req.tokens[-3:] == [1, 2, 7] and req.spec_run == 0


def test_padding_policy_keeps_the_old_ladder_rule():
    """ "padding" never leaves the bucket its one-token rows need: on (1, 16, 32) a lone decode
    has no padding, so it drafts nothing (why the runner gives "padding" no 1-token bucket)."""
    sched = _sched(draft_policy="padding")
    sched.add_request("a", list(range(20, 29)) + [1, 2, 3, 4, 1, 2, 3], 30)
    _step(sched, 4)
    assert _step(sched, 1).num_tokens == 1
    sched.token_buckets = (16, 32)
    ops = _step(sched, 2, accepted=0)
    assert ops.draft_lens[0] == 4 and ops.num_tokens == 5
