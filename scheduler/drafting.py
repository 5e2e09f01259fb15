"""The scheduler's side of speculative decoding: which running rows carry drafts in a step, and
what the acceptance model learns from the tokens they got.

The policy (the proposer, how many drafts pay for their bucket, the acceptance model and step
costs) is `scheduler.speculative`; here it meets the requests: `plan_drafts` asks every decode
row for its proposal before any row is planned, so the step's token bucket follows the
proposals, and `check_proposal` scores each proposal, drafted or not, against what the row
appended (`Scheduler.update_step`).
"""

from __future__ import annotations

from typing import cast

from scheduler.request import Request
from scheduler.speculative import AcceptanceModel, SpeculativeConfig, StepCosts, choose_drafts, propose_ngram
from scheduler.stop import tokens_left


def plan_drafts(
    spec: SpeculativeConfig,
    running: list[Request],
    ending: set[Request],
    *,
    max_rows: int,
    max_context_len: int,
    chunk_cap: int,
    token_buckets: tuple[int, ...],
    step_costs: StepCosts | None,
    spec_model: AcceptanceModel | None,
) -> dict[Request, list[int]]:
    """Every speculating decode row's proposal, then how many of its drafts the step carries
    (`speculative.choose_drafts`): request -> its drafts (rows with none left out). A row
    may propose when its tokens are all known (synchronous loop) and its prefill is done; its
    proposal is capped by the length limit (`stop.tokens_left`) and the chunk cap after its own
    token, and kept whole in `Request.proposal` for `update` to check (the acceptance model
    learns from rows that drafted nothing too). `ending`: requests planned no more."""
    k = spec.num_speculative_tokens
    reqs: list[Request] = []
    proposals: list[tuple[int, int]] = []
    num_rows = 0
    for req in running:
        if num_rows == max_rows:
            break
        req.proposal = None
        if ending and req in ending:
            continue
        num_rows += 1
        tokens = req.tokens
        if not (
            req.speculate
            and not req.num_pending
            and not req.num_inflight
            and req.prefill_done
            and len(tokens) - req.num_computed == 1
        ):
            continue
        n = min(k, tokens_left(req, max_context_len) - 1, chunk_cap - 1)
        proposal = propose_ngram(tokens, n, spec.prompt_lookup_min, spec.prompt_lookup_max) if n >= 1 else []
        req.proposal = proposal
        if proposal:
            reqs.append(req)
            proposals.append((len(proposal), req.spec_run))
    if not reqs:
        return {}
    counts = choose_drafts(spec, proposals, num_rows, token_buckets, max_rows, step_costs, spec_model)
    return {req: cast("list[int]", req.proposal)[:d] for req, d in zip(reqs, counts) if d}


def check_proposal(req: Request, new: list[int], live: bool, spec_model: AcceptanceModel | None) -> None:
    """Take the proposal `req` made for its row (drafted or not) and score it against the
    tokens `new` the row appended, when the row is live and appended any: the run of tokens
    proposals predicted (`Request.spec_run`) grows by the matches, or restarts at 0 on a miss;
    the acceptance model learns both."""
    proposal, req.proposal = req.proposal, None
    if proposal is None or not live or not new:
        return
    seen = min(len(new), len(proposal))
    m = 0
    while m < seen and new[m] == proposal[m]:
        m += 1
    missed = m < seen or not proposal  # no proposal: nothing predicted the token
    if spec_model is not None and proposal:
        spec_model.observe(req.spec_run, m, missed)
    req.spec_run = 0 if missed else req.spec_run + m
