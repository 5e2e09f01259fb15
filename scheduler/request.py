"""Per-request host state and the finished-request output record."""

from __future__ import annotations

import dataclasses
import enum

from scheduler.block_table import BlockTable
from scheduler.hashing import PrefixHasher
from scheduler.sampling_options import SamplingOptions
from scheduler.stop import check_stop


class Status(enum.Enum):
    WAITING = "waiting"  # never admitted, or retracted and waiting to resume
    RUNNING = "running"  # holds pages and a device slot
    # overlapped scheduling: its last token (a length limit) is in flight; pages and slot are
    # already released, `update` only appends that token and finishes it
    FINISHING = "finishing"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestOutput:
    """What `Scheduler.update` returns for a finished request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids (a stop token, if any, is the last one)
    finish_reason: str  # "length" | "stop" | "abort"
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_retractions: int = 0


class Request:
    """A request's host state. `tokens` = prompt + the generated ids known on the host;
    `num_computed` of them have KV. `sampling`: its sampling record, carried whole (the seed
    resolved by `SamplingOptions.for_request`).

    Overlapped scheduling (one step in flight while the next is planned) adds two counters:
    `num_inflight` tokens are scheduled in steps whose results have not come back yet (their KV
    is being written), and `num_pending` sampled tokens exist only on the device so far (their
    ids arrive with `update`). The request's virtual stream is `tokens` + `num_pending`
    placeholders. Each step schedules virtual positions `[num_scheduled, num_scheduled + n)`;
    the row samples iff that reaches the end of the virtual stream. A decode is n = 1 with one
    token (possibly a placeholder) left. In the synchronous loop both counters are 0 whenever
    `schedule()` runs. `epoch` counts releases (retraction, abort, finish): a step row records
    it so `update` can tell that the pages it wrote were given back meanwhile. A retracted
    request keeps `tokens` (its output folded in) and resumes with a fresh prefix match.
    """

    __slots__ = (
        "request_id",
        "prompt_len",
        "tokens",
        "max_new_tokens",
        "sampling",
        "arrival",
        "hasher",
        "status",
        "tables",
        "slot",
        "num_computed",
        "reserved",
        "prefill_done",
        "num_decode_rows",
        "needs_refresh",
        "num_cached_tokens",
        "num_retractions",
        "finish_reason",
        "published_base_pages",
        "admitted_once",
        "num_inflight",
        "num_pending",
        "epoch",
        "speculate",
        "drafts",
        "proposal",
        "spec_run",
    )

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        max_new_tokens: int,
        *,
        sampling: SamplingOptions,
        arrival: int,
        hash_base: int,
        cache_salt: str | bytes | None = None,
        speculate: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt_len = len(prompt)
        self.tokens = list(prompt)
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling.for_request(request_id)
        self.arrival = arrival
        salt = cache_salt or b""
        self.hasher = PrefixHasher(hash_base, salt.encode() if isinstance(salt, str) else salt)
        self.hasher.extend(self.tokens)
        self.status = Status.WAITING
        self.tables: list[BlockTable] | None = None
        self.slot = -1
        self.num_computed = 0
        self.reserved: tuple[int, ...] = ()  # pages promised to its next acquire, per pool; () none
        self.prefill_done = False
        self.num_decode_rows = 0
        self.needs_refresh = True
        self.num_cached_tokens = 0
        self.num_retractions = 0
        self.finish_reason: str | None = None
        self.published_base_pages = 0
        self.admitted_once = False
        self.num_inflight = 0  # tokens scheduled in steps not yet fed back by `update`
        self.num_pending = 0  # sampled tokens still on the device (placeholders on the host)
        self.epoch = 0  # bumped by every release; a step row whose epoch differs is stale
        self.speculate = speculate  # may propose drafts (speculative decoding)
        self.drafts: list[int] = []  # the drafts of its row in the step in flight
        # the n-gram proposal made when its decode row was planned (drafted or not; None: none
        # made), which `update` checks against the tokens the row got
        self.proposal: list[int] | None = None
        self.spec_run = 0  # its newest tokens that its proposals predicted, in a row

    @property
    def held_tables(self) -> list[BlockTable]:
        """Its tables while it holds pages (running, or finishing until released)."""
        assert self.tables is not None, f"request {self.request_id} holds no pages"
        return self.tables

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def num_scheduled(self) -> int:
        """Tokens whose KV is computed or being computed by a step in flight."""
        return self.num_computed + self.num_inflight

    @property
    def remaining(self) -> int:
        """Virtual tokens (known + pending) not yet scheduled."""
        return len(self.tokens) + self.num_pending - self.num_scheduled

    def finishes_by_length(self, max_context_len: int) -> bool:
        """True when the pending tokens will certainly end the request ("length"): then it is
        not planned again (a stop token can never be predicted, a length limit can; the one
        stop rule: `stop.check_stop`)."""
        return check_stop(self, max_context_len, ahead=self.num_pending) == "length"

    def output(self) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.tokens[: self.prompt_len],
            self.tokens[self.prompt_len :],
            self.finish_reason or "abort",
            self.num_cached_tokens,
            self.num_retractions,
        )
