"""Bounded soak of the HTTP server (issue 25): mixed clients against a real
`tokenspeed-jax serve --model tiny-random` subprocess on loopback, then a SIGTERM.

    python benchmarks/soak.py                     # 5 minutes, 16 clients
    python benchmarks/soak.py --duration-s 60     # shorter
    python benchmarks/soak.py --json out.json     # + the figures as JSON

Clients (asyncio + httpx), each looping until the end with a random request:
- stream: a streamed completion or chat (8-64 tokens), read to `[DONE]`;
- whole: the same, not streamed;
- abort: a stream whose client hangs up after a few chunks;
- abort_whole: a non-streamed request whose client gives up after 0.05-0.5 s.
Prompts come from a few shared prefixes plus a random tail (prefix-cache hits and misses).

Checks (the exit status is 1 when one fails):
- server errors: 0 (any 5xx, any error event inside a 200 stream, any transport error that the
  client did not cause itself, any finished choice without a finish reason);
- pages: every page free and nothing running or waiting once the clients stop;
- RSS growth of the server process between the first and the last window (medians of 1 s
  samples from /proc) below `--rss-bound-mb` (64 MB: the server holds ~1.1 GB, most of it the
  JAX runtime and compiled programs; a leak of one page table or output per request would pass
  it within minutes at this request rate);
- SIGTERM at the end: exit status 0 within the grace.
p50 / p99 latency of the completed requests is reported per window (first and last, and every
window in between), with the server's CPU use and the machine's load average, to tell a slower
server from a busier machine; it is reported, not checked (a shared machine's speed varies).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

ENGINE = [
    "--model",
    "tiny-random",
    "--page-size",
    "8",
    "--num-pages",
    "600",
    "--max-batch-requests",
    "8",
    "--max-scheduled-tokens",
    "64",
    "--max-context-len",
    "256",
]
PREFIXES = [
    "You are a helpful assistant. ",
    "Translate to French: ",
    "Summarise the text: ",
    "Q: what is the capital of ",
]
KINDS = ("stream", "whole", "abort", "abort_whole")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _body(rng: random.Random, stream: bool) -> tuple[str, dict]:
    tail = " ".join(str(rng.randrange(1000)) for _ in range(rng.randrange(1, 12)))
    prompt = rng.choice(PREFIXES) + tail
    common = {"max_tokens": rng.randrange(8, 65), "temperature": rng.choice([0.0, 0.7]), "stream": stream}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}
    return "/v1/completions", {"prompt": prompt, **common}


class Soak:
    def __init__(self, url: str, deadline: float, seed: int) -> None:
        self.url = url
        self.deadline = deadline
        self.seed = seed
        self.records: list[dict] = []  # {t, kind, latency, ok}
        self.errors: list[str] = []

    def _error(self, what: str) -> None:
        if len(self.errors) < 20:
            print(f"  server error: {what}", flush=True)
        self.errors.append(what)

    async def _stream(
        self, client: httpx.AsyncClient, path: str, body: dict, hang_up_after: int | None
    ) -> bool:
        """True when read to [DONE] (False: the client hung up on purpose)."""
        chunks = 0
        ended = set()
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                self._error(f"{path} stream: HTTP {r.status_code}")
                return True
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    if not ended:
                        self._error(f"{path} stream: [DONE] without a finish reason")
                    return True
                event = json.loads(data)
                if "error" in event:
                    self._error(f"{path} stream: error event {event['error']}")
                    return True
                for c in event.get("choices", []):
                    if c.get("finish_reason"):
                        ended.add(c["index"])
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    return False
        self._error(f"{path} stream: ended without [DONE]")
        return True

    async def _one(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        kind = rng.choice(KINDS)
        path, body = _body(rng, stream=kind in ("stream", "abort"))
        t0 = time.monotonic()
        completed = True
        try:
            if kind in ("stream", "abort"):
                completed = await self._stream(
                    client, path, body, rng.randrange(1, 4) if kind == "abort" else None
                )
            else:
                timeout = rng.uniform(0.05, 0.5) if kind == "abort_whole" else 120.0
                try:
                    r = await client.post(path, json=body, timeout=timeout)
                except httpx.TimeoutException:
                    if kind != "abort_whole":
                        raise
                    completed = False
                else:
                    choices = r.json().get("choices") if r.status_code == 200 else None
                    if not choices or any(not c.get("finish_reason") for c in choices):
                        self._error(f"{path}: HTTP {r.status_code} {r.text[:200]}")
        except httpx.HTTPError as e:
            self._error(f"{path} {kind}: {type(e).__name__} {e}")
        self.records.append({"t": t0, "kind": kind, "latency": time.monotonic() - t0, "completed": completed})

    async def client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        async with httpx.AsyncClient(base_url=self.url, timeout=120.0) as client:
            while time.monotonic() < self.deadline:
                await self._one(client, rng)


def _window(
    records: list[dict], samples: list[tuple[float, float, float, float]], lo: float, hi: float
) -> dict:
    """Requests that started in [lo, hi): count, client hang-ups, p50 / p99 latency of the
    completed ones; from the 1 s samples: median server RSS, server CPU use, machine load."""
    rows = [r for r in records if lo <= r["t"] < hi]
    lat = sorted(r["latency"] for r in rows if r["completed"])
    q = statistics.quantiles(lat, n=100) if len(lat) >= 2 else [float("nan")] * 99
    inside = [x for x in samples if lo <= x[0] < hi]
    cpu = (
        (inside[-1][2] - inside[0][2]) / (inside[-1][0] - inside[0][0]) if len(inside) >= 2 else float("nan")
    )
    return {
        "requests": len(rows),
        "aborted": sum(not r["completed"] for r in rows),
        "p50_ms": 1000 * q[49],
        "p99_ms": 1000 * q[98],
        "rss_mb": statistics.median(x[1] for x in inside) if inside else float("nan"),
        "server_cpu": cpu,
        "load": statistics.mean(x[3] for x in inside) if inside else 0.0,
    }


async def _sample(pid: int, until: float, out: list[tuple[float, float, float, float]]) -> None:
    """(time, server RSS MB, server CPU s, 1-minute load average) every second."""
    while time.monotonic() < until:
        out.append((time.monotonic(), _rss_mb(pid), _cpu_s(pid), os.getloadavg()[0]))
        await asyncio.sleep(1.0)


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited during start-up (status {proc.returncode})")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    sys.exit("the server did not become ready")


def _pages_back(url: str, within: float = 30.0) -> tuple[bool, dict]:
    deadline = time.monotonic() + within
    st: dict = {}
    while time.monotonic() < deadline:
        st = httpx.get(f"{url}/stats", timeout=10).json()
        if st["free_pages"] == st["total_pages"] and not st["num_running"] and not st["num_waiting"]:
            return True, st
        time.sleep(0.1)
    return False, st


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=300.0, help="soak length (default 300)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    ap.add_argument("--window-s", type=float, default=60.0, help="first / last window (60)")
    ap.add_argument(
        "--rss-bound-mb",
        type=float,
        default=64.0,
        help="allowed RSS growth, first to last window (default 64 MB)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cache = tempfile.mkdtemp(prefix="tokenspeed-soak-cache-")  # a fresh compile cache
    log = open(os.path.join(cache, "serve.log"), "w+")  # noqa: SIM115 - read at the end
    cmd = [
        sys.executable,
        "-m",
        "tokenspeed_jax.cli",
        "serve",
        *ENGINE,
        "--port",
        str(port),
        "--compile-cache-dir",
        cache,
        "--shutdown-grace-s",
        "10",
    ]
    t_start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")},
    )
    try:
        _wait_ready(url, proc, timeout=900)
        print(
            f"server ready in {time.monotonic() - t_start:.1f}s (pid {proc.pid}); soaking "
            f"{args.duration_s:g}s with {args.clients} clients",
            flush=True,
        )
        t0 = time.monotonic()
        soak = Soak(url, t0 + args.duration_s, args.seed)
        rss: list[tuple[float, float, float, float]] = []

        async def run() -> None:
            await asyncio.gather(
                _sample(proc.pid, soak.deadline, rss), *(soak.client(i) for i in range(args.clients))
            )

        asyncio.run(run())
        pages_ok, stats = _pages_back(url)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        rc = proc.wait(timeout=60)
        term_s = time.monotonic() - t_term
    finally:
        if proc.poll() is None:
            proc.kill()
    w = min(args.window_s, args.duration_s / 2)
    end = t0 + args.duration_s
    first = _window(soak.records, rss, t0, t0 + w)
    last = _window(soak.records, rss, end - w, end + 3600)
    growth = last["rss_mb"] - first["rss_mb"]
    kinds = {k: sum(r["kind"] == k for r in soak.records) for k in KINDS}
    queue_count = next(
        (
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("tokenspeed_queue_time_seconds_count")
        ),
        0.0,
    )
    print(
        f"\nrequests: {len(soak.records)} ({', '.join(f'{k} {v}' for k, v in kinds.items())}); "
        f"queue-time samples in /metrics: {queue_count:.0f}"
    )
    print(
        "| window | requests | client hang-ups | p50 latency ms | p99 latency ms | server RSS MB "
        "| server CPU (cores) | load avg |"
    )
    print("|---|---|---|---|---|---|---|---|")
    # every window in turn (the first is "first"); the last w seconds too when not on that grid
    starts = [k * w for k in range(int(args.duration_s // w))]
    rows = [(f"{lo:g}-{lo + w:g} s", _window(soak.records, rss, t0 + lo, t0 + lo + w)) for lo in starts]
    if not starts or starts[-1] + w != args.duration_s:
        rows.append((f"last {w:g} s", last))
    for name, row in rows:
        print(
            f"| {name} | {row['requests']} | {row['aborted']} | {row['p50_ms']:.0f} | "
            f"{row['p99_ms']:.0f} | {row['rss_mb']:.1f} | {row['server_cpu']:.2f} | "
            f"{row['load']:.1f} |"
        )
    print(f"RSS over the run: min {min(x[1] for x in rss):.1f} MB, max {max(x[1] for x in rss):.1f} MB")
    checks = {
        "server errors = 0": not soak.errors,
        "every page back, nothing running or waiting": pages_ok,
        f"RSS growth {growth:+.1f} MB <= {args.rss_bound_mb:g} MB": growth <= args.rss_bound_mb,
        f"SIGTERM: exit status {rc} in {term_s:.1f}s": rc == 0,
    }
    print(
        f"server errors: {len(soak.errors)}; pages free {stats.get('free_pages')}/{stats.get('total_pages')}"
    )
    for what, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {what}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "duration_s": args.duration_s,
                    "clients": args.clients,
                    "kinds": kinds,
                    "first": first,
                    "last": last,
                    "rss_growth_mb": growth,
                    "server_errors": soak.errors,
                    "pages_back": pages_ok,
                    "exit_status": rc,
                    "sigterm_exit_s": term_s,
                },
                f,
                indent=1,
            )
    if not all(checks.values()):
        log.seek(0)
        print(log.read()[-4000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
