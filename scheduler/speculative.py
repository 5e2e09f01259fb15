"""Speculative decoding on the host: the n-gram (prompt-lookup) proposer and its config.

Each step, a decode row whose request may speculate proposes up to k draft tokens: the longest
suffix of its tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) that occurred
earlier in prompt + output, and the (up to k) tokens that followed its most recent earlier
occurrence. The row then runs 1 + d query tokens (its last token and the d drafts); the device
verifies the drafts (`tokenspeed_jax.runtime.spec_verify.verify_drafts`) and returns how many it accepted; the
scheduler keeps the accepted prefix plus the device's own next token and rolls the rest back
(`CacheCoordinator.truncate`).

How many drafts a step carries, and so its token bucket, is the host's choice (`draft_policy`).
The proposer runs on the host before the step is built, so the scheduler knows every row's
proposal before it picks the bucket:
  - "cost" (default): the step runs in the bucket that maximises its expected tokens per second,
    (rows + expected accepted drafts) / step cost. A step whose rows propose nothing stays in
    the bucket its one-token rows need (the 1-token bucket for a lone decode on CPU); drafts go
    in the padding of that bucket for free, and into a bigger bucket only when they are
    expected to pay for it. Expected accepted drafts come from `AcceptanceModel` (each row's run
    of tokens its proposals predicted, learnt from every proposal's outcome, drafted or not),
    step costs from `StepCosts` (decode steps the engine timed, per bucket);
  - "padding": drafts only fill the padding of the bucket the one-token rows occupy, shared
    evenly (the runner then keeps no 1-token bucket: a lone decode would leave no padding);
  - "always": up to k drafts per row whatever the bucket (memory-bound accelerators, where a
    bigger bucket costs little).
"""

from __future__ import annotations

import dataclasses
import heapq
import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

METHODS = ("ngram",)
DRAFT_POLICIES = ("cost", "padding", "always")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for n-gram speculation.

    num_speculative_tokens: k, the most drafts one row proposes per step (>= 1).
    prompt_lookup_max / prompt_lookup_min: the longest / shortest suffix n-gram matched.
    draft_policy (ours, not vLLM's): how many drafts a step carries (module docstring):
        "cost" (default), "padding" or "always". The dict spelling also takes the older
        `padding_only` key: True = "padding", False = "always".
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    draft_policy: str = "cost"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {value!r}")
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(
                f"speculative_config.draft_policy must be one of "
                f"{list(DRAFT_POLICIES)}, got {self.draft_policy!r}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                f"> prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, or vLLM's dict spelling (unknown keys: ValueError)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} | {"padding_only"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        kw = dict(value)
        if "padding_only" in kw:  # the older spelling of the "padding" / "always" policies
            only = kw.pop("padding_only")
            if not isinstance(only, bool):
                raise ValueError(f"speculative_config.padding_only must be a bool, got {only!r}")
            if "draft_policy" in kw:
                raise ValueError("speculative_config: give draft_policy or padding_only, not both")
            kw["draft_policy"] = "padding" if only else "always"
        return cls(**kw)


class AcceptanceModel:
    """How likely a row's next proposed token is right, given its run: the tokens its latest
    proposals predicted in a row (`Request.spec_run`). Runs are binned 0, 1, ..., `BINS` - 1
    (the last bin: that many or more); each bin counts hits / tries over every proposal's
    outcome, drafted or shadowed (a row that proposed but did not draft is checked against the
    token it got), starting from `PRIOR` weighted as `PRIOR_TRIES` tries. A bin halves its
    counts past `MAX_TRIES`, so it follows the workload. A draft j accepted moves the run one up,
    so the expected accepted count of d drafts from run r is
    sum_{j<d} prod_{i<=j} q(r + i) (`gains`: its terms, the marginal value of each draft)."""

    BINS = 5
    # measured on SmolLM2 chat / copy outputs: a first match after a miss is right about half
    # the time, after 3+ matches ~90% (docs: issue 44)
    PRIOR = (0.5, 0.7, 0.8, 0.9, 0.9)
    PRIOR_TRIES = 2.0
    MAX_TRIES = 256.0

    def __init__(self) -> None:
        self.hits = [q * self.PRIOR_TRIES for q in self.PRIOR]
        self.tries = [self.PRIOR_TRIES] * self.BINS

    def _bin(self, run: int) -> int:
        return min(run, self.BINS - 1)

    def q(self, run: int) -> float:
        """P(the next proposed token is right | the row's run)."""
        b = self._bin(run)
        return self.hits[b] / self.tries[b]

    def observe(self, run: int, matched: int, missed: bool) -> None:
        """A proposal made at `run` had `matched` leading tokens right, then one wrong if
        `missed` (else the tokens seen ended first)."""
        for i in range(matched + missed):
            b = self._bin(run + i)
            self.hits[b] += i < matched
            self.tries[b] += 1.0
            if self.tries[b] > self.MAX_TRIES:
                self.hits[b] *= 0.5
                self.tries[b] *= 0.5

    def gains(self, run: int, d: int) -> list[float]:
        """The expected accepted count each of d drafts adds: P(drafts 1..j all accepted)."""
        out, p = [], 1.0
        for i in range(d):
            p *= self.q(run + i)
            out.append(p)
        return out


class StepCosts:
    """Seconds per step of each token bucket: the median of the last `window` decode steps the
    engine timed in it (a median: a step slowed by a busy core is an outlier; steps that
    compiled are never timed). A bucket not timed yet is estimated from the nearest timed one
    as if a step cost a fixed part plus a per-token part, equal at `HALF` tokens (a 16-token
    bucket ~1.9x a 1-token one, 32 ~1.5x 16; an AVX-512 2-core VM measured SmolLM2 f32 at ~2x
    and ~1.6x), so "cost" tries a bigger bucket when drafts look good, and its timing then
    replaces the guess. A bucket not timed in the last `stale` timed steps is forgotten (timed
    slow once, e.g. beside another job, it would never be chosen, so never timed again): a
    bucket truly worse then costs one step in `stale`, under 1% of the decode time."""

    HALF = 16.0

    def __init__(self, window: int = 16, stale: int = 128) -> None:
        self.window = window
        self.stale = stale
        self._times: dict[int, deque[float]] = {}
        self._median: dict[int, float] = {}
        self._last: dict[int, int] = {}  # bucket -> the count of timed steps at its newest
        self._count = 0

    def observe(self, bucket: int, seconds: float) -> None:
        self._count += 1
        times = self._times.setdefault(bucket, deque(maxlen=self.window))
        times.append(seconds)
        self._median[bucket] = statistics.median(times)
        self._last[bucket] = self._count
        for b in [b for b, at in self._last.items() if self._count - at > self.stale]:
            del self._times[b], self._median[b], self._last[b]

    def measured(self) -> dict[int, float]:
        """bucket -> median seconds of the timed buckets."""
        return dict(self._median)

    def cost(self, bucket: int) -> float:
        """The bucket's step seconds: timed, else scaled from the nearest timed bucket (in
        relative units when none is)."""
        if bucket in self._median:
            return self._median[bucket]
        if not self._median:
            return bucket + self.HALF
        near = min(self._median, key=lambda b: abs(b - bucket) / min(b, bucket))
        return self._median[near] * (bucket + self.HALF) / (near + self.HALF)


def choose_drafts(
    spec: SpeculativeConfig,
    proposals: list[tuple[int, int]],
    num_rows: int,
    token_buckets: tuple[int, ...],
    max_rows: int,
    costs: StepCosts | None = None,
    model: AcceptanceModel | None = None,
) -> list[int]:
    """How many drafts each proposing row carries this step.

    proposals: (proposal length, the row's run) per row that proposed, in row order (lengths
    already capped at what the row may carry); num_rows: the step's running rows (capped at
    `max_rows`), each one token before drafts; token_buckets: the runner's, ascending (() =
    unknown: every row carries its whole proposal). `costs` / `model` (the "cost" policy;
    None: fresh ones) estimate step seconds and accepted drafts."""
    lengths = [n for n, _ in proposals]
    rows = min(num_rows, max_rows)
    if spec.draft_policy == "always" or not token_buckets or rows == 0 or not any(lengths):
        return lengths
    b0 = next((b for b in token_buckets if b >= rows), token_buckets[-1])
    if spec.draft_policy == "padding":
        # the bucket's padding, shared evenly (at least one per row while any is left)
        left = max(0, b0 - rows)
        cap = min(spec.num_speculative_tokens, max(1, left // rows))
        out = []
        for n in lengths:
            out.append(min(n, cap, left))
            left -= out[-1]
        return out
    costs = costs if costs is not None else StepCosts()
    model = model if model is not None else AcceptanceModel()
    # every draft's marginal expected gain, best first: within a row they only decrease, so
    # the best c of them are a prefix of each row's proposal (ties: earlier row, earlier draft)
    ranked = heapq.nsmallest(
        max(0, token_buckets[-1] - rows),
        ((-g, i, j) for i, (n, run) in enumerate(proposals) for j, g in enumerate(model.gains(run, n))),
    )
    best_value, best_room = rows / costs.cost(b0), 0
    gained = 0.0
    taken = 0
    for b in token_buckets:
        if b < b0:
            continue
        room = min(b - rows, len(ranked))
        while taken < room:
            gained -= ranked[taken][0]
            taken += 1
        value = (rows + gained) / costs.cost(b)
        if value > best_value:
            best_value, best_room = value, room
        if room == len(ranked):
            break  # every draft fits: a bigger bucket only costs more
    out = [0] * len(proposals)
    for _, i, _ in ranked[:best_room]:
        out[i] += 1
    return out


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k drafts continuing `tokens`: the tokens after the most recent earlier occurrence
    of the longest suffix n-gram (n_max down to n_min); [] when no suffix recurs.

    Searched as bytes (`bytes.rfind`, C speed): an int32 match must also sit on a 4-byte
    boundary, so unaligned hits are skipped."""
    size = len(tokens)
    if k < 1 or size < n_min + 1:
        return []
    buf = np.asarray(tokens, np.int32).tobytes()
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        pattern = buf[(size - n) * 4 :]
        end = (size - 1) * 4  # earlier occurrences end before the last token
        while True:
            at = buf.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                first = at // 4 + n
                return list(tokens[first : first + k])
            end = at + len(pattern) - 1
    return []
