"""A synthetic agentic workload: sessions sharing a long system prompt, with multi-turn follow-ups.

Each session's turn k+1 is sent when turn k finishes, with the whole conversation so far as its
prompt (system prompt + every earlier user message and reply + a new user message): the shape of
agent loops and chat, and the best case for a prefix cache. `run_workload` drives it directly on
an `Engine`; `workloads.loadgen` sends the same `WorkloadConfig` to an HTTP server (`bench serve`).
This module imports no jax (nor does `engine`), so the load generator stays jax-free.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from tokenspeed_jax.engine.engine import Engine
from tokenspeed_jax.engine.replicas import Replicas
from tokenspeed_jax.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    """The workload's shape: `sessions` conversations of `turns` requests each, sharing a
    `system_tokens`-token system prompt; every turn adds `user_tokens` and asks for `max_tokens`."""

    sessions: int = 16
    turns: int = 3
    system_tokens: int = 384
    user_tokens: int = 24
    max_tokens: int = 24
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = True  # fixed-length replies (comparable runs); chat text stops at EOS

    @property
    def longest_request(self) -> int:
        """Tokens (prompt + reply) of a session's last turn: the longest request sent."""
        return self.system_tokens + self.turns * (self.user_tokens + self.max_tokens)


@dataclasses.dataclass
class WorkloadReport:
    requests: int
    prompt_tokens: int
    computed_prompt_tokens: int  # prompt tokens actually run (prefix-cache hits excluded)
    generated_tokens: int
    wall_s: float
    steps: int
    ttft_s: list[float]
    tpot_s: list[float]
    prefix_hit_rate: float
    retractions: int
    peak_pages: int
    total_pages: int
    compiles: int
    state_pages: int = 0  # a hybrid model's state pool (`SchedulerConfig.state_pages`; 0: none)

    def summary(self) -> dict:
        pct = lambda xs, q: float(np.percentile(xs, q)) * 1e3 if xs else float("nan")  # noqa: E731
        return {
            "requests": self.requests,
            "steps": self.steps,
            "wall_s": round(self.wall_s, 2),
            "prompt_tokens": self.prompt_tokens,
            "computed_prompt_tokens": self.computed_prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "output_tok_per_s": round(self.generated_tokens / self.wall_s, 1),
            "computed_tok_per_s": round(
                (self.computed_prompt_tokens + self.generated_tokens) / self.wall_s, 1
            ),
            "ttft_ms_p50": round(pct(self.ttft_s, 50), 1),
            "ttft_ms_p90": round(pct(self.ttft_s, 90), 1),
            "ttft_ms_p99": round(pct(self.ttft_s, 99), 1),
            "tpot_ms_p50": round(pct(self.tpot_s, 50), 1),
            "tpot_ms_p90": round(pct(self.tpot_s, 90), 1),
            "tpot_ms_p99": round(pct(self.tpot_s, 99), 1),
            "prefix_hit_rate": round(self.prefix_hit_rate, 3),
            "retractions": self.retractions,
            "peak_pages": self.peak_pages,
            "total_pages": self.total_pages,
            **({"state_pages": self.state_pages} if self.state_pages else {}),
            "compiles": self.compiles,
        }


def run_workload(
    engine: Engine | Sequence[Engine],
    cfg: WorkloadConfig,
    *,
    vocab: int = 256,
    progress: bool = False,
    prompts=None,
    route: str = "prefix",
) -> WorkloadReport:
    """Serve the workload to completion on `engine` (or on every data-parallel replica of a
    list, driven by `engine.replicas.Replicas`: every busy replica steps once per round, in
    threads); returns latency / throughput / cache figures.

    route: how requests are spread over the replicas: "prefix" (the default: the longest
    prefix-cache match, ties to the least loaded) or "load" (fewest outstanding tokens).

    prompts: None = random token ids below `vocab`; else an object with `first(session)` and
    `follow(session, turn, history, reply)` returning token ids, and `record(session, turn,
    reply)` called on every finished request (`workloads.chat_prompts.ChatPrompts`: chat-templated text)."""
    engines = [engine] if isinstance(engine, Engine) else list(engine)
    replicas = Replicas(engines, route=route)
    rng = np.random.default_rng(cfg.seed)
    system = rng.integers(0, vocab, cfg.system_tokens).tolist()
    history: dict[str, list[int]] = {}
    turn_of: dict[str, int] = {}
    session_of: dict[str, int] = {}
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, ignore_eos=cfg.ignore_eos)
    total = cfg.sessions * cfg.turns
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="requests", unit="req")

    def send(session: int, turn: int, prompt: list[int]) -> None:
        _, rid = replicas.submit(prompt, params, f"s{session:03d}-t{turn}")
        history[rid] = prompt
        turn_of[rid] = turn
        session_of[rid] = session

    for s in range(cfg.sessions):
        send(
            s,
            0,
            system + rng.integers(0, vocab, cfg.user_tokens).tolist()
            if prompts is None
            else prompts.first(s),
        )
    ttft, tpot = [], []
    prompt_tokens = generated = done = 0
    for e in engines:  # peak pages: each pool's high-water mark over this workload
        e.scheduler.pool.reset_peak()
    prefill0 = sum(e.num_prefill_tokens for e in engines)
    steps0 = sum(e.num_steps for e in engines)
    t0 = time.perf_counter()
    while replicas.has_unfinished():
        for out in replicas.step_busy():
            done += 1
            prompt_tokens += len(out.prompt_token_ids)
            generated += len(out.token_ids)
            if out.metrics is not None and out.metrics.ttft is not None:
                ttft.append(out.metrics.ttft)
            if out.tpot is not None:
                tpot.append(out.tpot)
            if bar is not None:
                bar.update(1)
            nxt = turn_of[out.request_id] + 1
            sid = session_of[out.request_id]
            if prompts is not None:
                prompts.record(sid, nxt - 1, out.token_ids)
            if nxt < cfg.turns:
                if prompts is not None:
                    send(sid, nxt, prompts.follow(sid, nxt, history[out.request_id], out.token_ids))
                    continue
                # drawn per (session, turn), not from the shared stream: the prompts must not
                # depend on the order requests finish in (loops / engines compare token for token)
                follow = (
                    np.random.default_rng((cfg.seed, sid, nxt)).integers(0, vocab, cfg.user_tokens).tolist()
                )
                send(sid, nxt, history[out.request_id] + out.token_ids + follow)
    wall = time.perf_counter() - t0
    # one replica: its exact high-water mark; several: the sum of theirs (an upper bound)
    peak = sum(e.scheduler.pool.peak_used for e in engines)
    replicas.close()
    if bar is not None:
        bar.close()
    stats = replicas.stats()
    return WorkloadReport(
        requests=done,
        prompt_tokens=prompt_tokens,
        computed_prompt_tokens=sum(e.num_prefill_tokens for e in engines) - prefill0,
        generated_tokens=generated,
        wall_s=wall,
        steps=sum(e.num_steps for e in engines) - steps0,
        ttft_s=ttft,
        tpot_s=tpot,
        prefix_hit_rate=stats["prefix_hit_rate"],
        retractions=stats["num_retractions"],
        peak_pages=peak,
        total_pages=stats["total_pages"],
        compiles=stats.get("num_compiles", 0),
        state_pages=stats.get("state_total_pages", 0),
    )
