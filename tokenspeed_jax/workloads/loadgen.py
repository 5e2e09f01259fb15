"""Load generator of `bench serve`: the agentic workload (`workload.WorkloadConfig`) against an
OpenAI-compatible server.

Sessions share one system prompt; each session's turn k+1 (the whole conversation so far plus a
new user message) is sent as soon as turn k's reply is complete. Session starts arrive as a
Poisson process (or at a fixed rate) of `rate` sessions per second (inf = all at once), and at
most `max_concurrency` requests are in flight. Prompts are token ids, so any tokenizer works.
Every request streams (`stream_options.include_usage`), so TTFT and inter-token latencies are
measured at the client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

import numpy as np

from tokenspeed_jax.workloads.agentic import WorkloadConfig


@dataclasses.dataclass
class RequestRecord:
    start: float  # seconds since the level started
    ttft: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)  # gaps between chunks after the 1st
    latency: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.latency is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def _one(
    client,
    url: str,
    model: str,
    prompt: list[int],
    wl: WorkloadConfig,
    t0: float,
    records: list[RequestRecord],
) -> list[int] | None:
    import json

    rec = RequestRecord(start=time.perf_counter() - t0, prompt_tokens=len(prompt))
    records.append(rec)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": wl.max_tokens,
        "temperature": wl.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": wl.ignore_eos,
    }
    begin = last = time.perf_counter()
    ids: list[int] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                if rec.ttft is None:
                    rec.ttft = now - begin
                else:
                    rec.itl.append(now - last)
                last = now
                ids += chunk["choices"][0].get("token_ids") or []
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        rec.error = f"{type(e).__name__}: {e}"
        return None
    rec.latency = time.perf_counter() - begin
    return ids


async def run_level(
    url: str,
    model: str,
    wl: WorkloadConfig,
    *,
    rate: float,
    max_concurrency: int,
    arrival: str = "poisson",
    vocab: int = 256,
) -> tuple[list[RequestRecord], float]:
    """Serve the workload once (random prompt ids below `vocab`); returns (request records,
    wall seconds)."""
    import httpx

    rng = np.random.default_rng(wl.seed)
    system = rng.integers(0, vocab, wl.system_tokens).tolist()
    users = [
        [rng.integers(0, vocab, wl.user_tokens).tolist() for _ in range(wl.turns)] for _ in range(wl.sessions)
    ]
    if math.isinf(rate):
        starts = np.zeros(wl.sessions)
    elif arrival == "poisson":
        starts = np.cumsum(rng.exponential(1.0 / rate, wl.sessions))
    else:
        starts = np.arange(wl.sessions) / rate
    gate = asyncio.Semaphore(max_concurrency)
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=max_concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def session(i: int) -> None:
            await asyncio.sleep(max(0.0, starts[i] - (time.perf_counter() - t0)))
            history = list(system)
            for turn in range(wl.turns):
                prompt = history + users[i][turn]
                async with gate:
                    reply = await _one(client, url, model, prompt, wl, t0, records)
                if reply is None:
                    return
                history = prompt + reply

        await asyncio.gather(*(session(i) for i in range(wl.sessions)))
        wall = time.perf_counter() - t0
    return records, wall


def summarize(records: list[RequestRecord], wall: float, *, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """Throughput, TTFT / TPOT / ITL / e2e p50 / p90 / p99 (ms) and goodput (requests / s that
    met both SLOs)."""
    ok = [r for r in records if r.error is None and r.latency is not None]
    pct = {50: "p50", 90: "p90", 99: "p99"}

    def stats(name: str, xs: list[float]) -> dict:
        if not xs:
            return {f"{name}_ms_{k}": None for k in pct.values()} | {f"{name}_ms_mean": None}
        a = np.asarray(xs) * 1e3
        out = {f"{name}_ms_{k}": round(float(np.percentile(a, q)), 2) for q, k in pct.items()}
        out[f"{name}_ms_mean"] = round(float(a.mean()), 2)
        return out

    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    good = [
        r
        for r in ok
        if r.ttft is not None and r.ttft <= slo_ttft_s and (r.tpot is None or r.tpot <= slo_tpot_s)
    ]
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": round(wall, 3),
        "request_throughput": round(len(ok) / wall, 3),
        "output_throughput": round(out_tokens / wall, 2),
        "total_token_throughput": round((in_tokens + out_tokens) / wall, 2),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        **stats("ttft", [r.ttft for r in ok if r.ttft is not None]),
        **stats("tpot", [r.tpot for r in ok if r.tpot is not None]),
        **stats("itl", [x for r in ok for x in r.itl]),
        **stats("e2el", [r.latency for r in ok if r.latency is not None]),
        "goodput": round(len(good) / wall, 3),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
