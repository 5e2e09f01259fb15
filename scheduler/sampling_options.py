"""`SamplingOptions`: one request's sampling record, validated once and carried whole from the API
(`SamplingParams.to_options()`, or `Scheduler.add_request`'s keyword options) through
`Request.sampling` to the StepOps builder.

Each option is described once, at its field: its default (also its "off" value, equal to the
StepOps column's padding), its `Limit` (`LIMITS` is the one table of allowed values;
`SamplingParams` validates with it too) and the StepOps column(s) it fills (`COLUMNS`: the
builder fills them by looping over it; a column's dtype, shape and padding are the StepOps
field's own). Adding an option: a field here, its StepOps column (scheduler/step_ops.py), the
device code that reads it, and the `SamplingParams` field that exposes it; the scheduler, the
request and the builder need no edit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple

from scheduler.step_ops import LOGIT_BIAS_WIDTH


@dataclasses.dataclass(frozen=True)
class Limit:
    """Allowed values of one option.

    kind "number": a finite number (an int where `integer`; never a bool) in [lo, hi], ends open
    where said, or one of `also`. "ids": a collection of token ids (ints >= 0); None = none.
    "bias": {token id >= 0: a number as "number" would allow}, at most `max_len` entries; None =
    none. "flag": anything, taken as a bool.
    """

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    also: tuple[int | None, ...] = ()
    kind: str = "number"
    max_len: int | None = None

    def allows(self, value: object) -> bool:
        """Whether `value` is a number this limit allows (kind "number"; a bias value)."""
        if value is None or isinstance(value, bool):
            return value is None and None in self.also
        x: float
        if isinstance(value, numbers.Integral):
            x = int(value)  # exact, however large
        elif isinstance(value, numbers.Real) and not self.integer:
            x = float(value)
            if not math.isfinite(x):
                return False
        else:
            return False
        if x in self.also:
            return True
        above = x > self.lo if self.lo_open else x >= self.lo
        below = x < self.hi if self.hi_open else x <= self.hi
        return above and below

    def __str__(self) -> str:
        if self.kind == "flag":
            return "a bool"
        if self.kind == "ids":
            return "token ids (ints >= 0)"
        if self.kind == "bias":
            return (
                f"{{token id >= 0: bias}} with each bias {Limit(self.lo, self.hi)}, at most "
                f"{self.max_len} entries"
            )
        what = "an int" if self.integer else "a finite number"
        if self.hi == math.inf:
            rule = f"{what} {'>' if self.lo_open else '>='} {self.lo:g}"
        else:
            rule = (
                f"{what} in {'(' if self.lo_open else '['}{self.lo:g}, "
                f"{self.hi:g}{')' if self.hi_open else ']'}"
            )
        return " or ".join([*(repr(a) for a in self.also), rule])


TOKEN_ID = Limit(0, integer=True)


class ParamError(ValueError):
    """A value `check` (or `SamplingParams`) refused; `param` names the option it was given for,
    so a caller can point at its own field (the server names the request field the client sent)
    without parsing the message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _option(
    default: Any,
    limit: Limit,
    column: str | tuple[str, ...] = (),
    *,
    extra: bool = False,
    penalty: bool = False,
) -> Any:
    """A `SamplingOptions` field. column: the StepOps column(s) it fills (a field of (id, value)
    pairs fills two [R, B] columns). extra: filled only on rows whose record `needs_extras`
    (others keep the padding); the rest are filled on every row (the decode fast path gathers
    them per device slot). penalty: a non-default value makes `has_penalties` true."""
    columns = (column,) if isinstance(column, str) else column
    return dataclasses.field(
        default=default, metadata={"limit": limit, "columns": columns, "extra": extra, "penalty": penalty}
    )


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """How to sample one request (the per-request sampling fields the scheduler and device need).

    temperature 0 = greedy; top_p in (0, 1]; top_k -1 = all; seed: None = derived from the
    request id when the request is created (`for_request`, so reruns reproduce), only its low 32
    bits are used; stop_token_ids: generation ends on one of these (it is the last token);
    prompt_logprobs: the device computes each prompt token's logprob (such requests skip the
    prefix cache); presence / frequency_penalty (0 = off), repetition_penalty (1 = off),
    logit_bias ((token id, bias) pairs, sorted by id; a mapping is accepted) and top_logprobs
    (0 = off) modify or report the logits on the device (`tokenspeed_jax.runtime.sampling`).
    The constructor normalises (numbers to int / float, ids to a frozenset, a bias mapping to
    sorted pairs) and raises ValueError naming the field on a value `LIMITS` refuses.
    """

    temperature: float = _option(0.0, Limit(0.0), "temperature")
    top_p: float = _option(1.0, Limit(0.0, 1.0, lo_open=True), "top_p")
    top_k: int = _option(-1, Limit(1, integer=True, also=(-1,)), "top_k")
    seed: int | None = _option(None, Limit(0, integer=True, also=(None,)), "seeds")
    stop_token_ids: frozenset[int] = _option(frozenset(), Limit(kind="ids"))
    prompt_logprobs: bool = _option(False, Limit(kind="flag"))
    presence_penalty: float = _option(0.0, Limit(-2.0, 2.0), "presence_penalty", extra=True, penalty=True)
    frequency_penalty: float = _option(0.0, Limit(-2.0, 2.0), "frequency_penalty", extra=True, penalty=True)
    repetition_penalty: float = _option(
        1.0, Limit(0.0, 1e4, lo_open=True), "repetition_penalty", extra=True, penalty=True
    )
    logit_bias: tuple[tuple[int, float], ...] = _option(
        (),
        Limit(-100.0, 100.0, kind="bias", max_len=LOGIT_BIAS_WIDTH),
        ("logit_bias_ids", "logit_bias_values"),
        extra=True,
    )
    top_logprobs: int = _option(0, Limit(0, 20, integer=True), "top_logprobs", extra=True)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = check(f.name, getattr(self, f.name))
            if f.name == "stop_token_ids":
                value = frozenset(value)
            elif f.name == "seed" and value is not None:
                value &= 0xFFFFFFFF
            object.__setattr__(self, f.name, value)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SamplingOptions:
        """The record of keyword options (`Scheduler.add_request(**options)`): field names, None =
        the default. ValueError naming unknown names, the derived flags included."""
        unknown = set(options) - set(LIMITS)
        if unknown:
            derived = sorted(unknown & set(DERIVED))
            note = f" ({', '.join(derived)}: derived from the other options)" if derived else ""
            raise ValueError(f"unknown options {sorted(unknown)}{note}")
        return cls(**{k: v for k, v in options.items() if v is not None})

    def for_request(self, request_id: str) -> SamplingOptions:
        """This record with a concrete seed: None becomes one derived from `request_id`."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=zlib.crc32(request_id.encode()))

    @functools.cached_property
    def has_penalties(self) -> bool:
        """A penalty is on: the device counts this request's tokens, so the request skips the
        prefix cache (every token it holds passes through a step; see runtime/sampling.py)."""
        return any(getattr(self, f.name) != f.default for f in _FIELDS if f.metadata["penalty"])

    @functools.cached_property
    def needs_extras(self) -> bool:
        """Some "extra" column (penalties, logit_bias, top_logprobs) differs from padding."""
        return any(getattr(self, f.name) != f.default for f in _FIELDS if f.metadata["extra"])


DERIVED = ("has_penalties", "needs_extras")  # properties of the record, never options
_FIELDS = dataclasses.fields(SamplingOptions)
LIMITS: Mapping[str, Limit] = {f.name: f.metadata["limit"] for f in _FIELDS}


class Column(NamedTuple):
    """StepOps column(s) one `SamplingOptions` field fills (see `_option`)."""

    field: str
    columns: tuple[str, ...]  # one per-row column; two ([R, B] ids, values) for (id, value) pairs
    extra: bool


COLUMNS = tuple(
    Column(f.name, f.metadata["columns"], f.metadata["extra"]) for f in _FIELDS if f.metadata["columns"]
)


def check(name: str, value: Any, owner: str = "") -> Any:
    """`value` of option `name` normalised (numbers as int / float, ids as a tuple, a bias as
    (id, bias) pairs sorted by id, a flag as a bool); `ParamError(name, "{owner}{name} ...")`
    naming the rule when `LIMITS[name]` refuses it."""
    limit = LIMITS[name]
    if limit.kind == "flag":
        return bool(value)
    if limit.kind == "number":
        if not limit.allows(value):
            raise ParamError(name, f"{owner}{name} must be {limit}, got {value!r}")
        return None if value is None else int(value) if limit.integer else float(value)
    if value is None:
        return ()
    if limit.kind == "ids":
        try:
            ids = tuple(value)
        except TypeError:
            raise ParamError(name, f"{owner}{name} must be {limit}, got {value!r:.80}") from None
        bad = [t for t in ids if not TOKEN_ID.allows(t)]
        if bad:
            raise ParamError(name, f"{owner}{name} must be {limit}, got {bad[0]!r} in it")
        return tuple(int(t) for t in ids)
    try:  # "bias"
        pairs = sorted((int(t), float(b)) for t, b in dict(value).items())
    except (TypeError, ValueError):
        raise ParamError(name, f"{owner}{name} must be {limit}, got {value!r:.80}") from None
    bad = [t for t, b in pairs if t < 0 or not limit.allows(b)]
    if bad:
        raise ParamError(
            name, f"{owner}{name} must be {limit}, got token {bad[0]} with {dict(pairs)[bad[0]]}"
        )
    if limit.max_len is not None and len(pairs) > limit.max_len:
        raise ParamError(name, f"{owner}{name} must be {limit}, got {len(pairs)} entries")
    return tuple(pairs)
