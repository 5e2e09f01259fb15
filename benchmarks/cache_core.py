"""Cache-core benchmark (issue 2): host cost of one decode step vs context length.

One request holds three cache groups on one shared pool (DESIGN.md §4 example):
  full     full history,  B=256
  sliding  sliding window, B=128, W=511
  conv     live-tail sliding window, B=8, W=12 (alignment = coordinator lcm = 256)
It is prefilled to a context of 4k / 32k / 128k tokens, then decodes. One decode step is
  acquire(1 token) + hash the new base page if one completed + publish completed pages
  + reclaim slid-out slots
i.e. exactly what the scheduler runs per decoding request. The cost per step must not grow with
the context (128k / 4k ratio <= 1.2). Contexts are measured interleaved (pass after pass, best
of N) so machine noise hits all of them alike.

Also prints the admission transient of live-tail: pages a fresh 8192-token first chunk pins in
the conv group with and without live-tail allocation (64 vs 1024).

    python benchmarks/cache_core.py            # full run
    python benchmarks/cache_core.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# Run as a script, this folder is sys.path[0] and benchmarks/scheduler.py would shadow the
# `scheduler` package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from scheduler import BlockPool, CacheCoordinator, PagedCacheGroupSpec  # noqa: E402
from scheduler.hashing import PrefixHasher  # noqa: E402

CONTEXTS = (4096, 32768, 131072)


def group_specs(live_tail: bool = True) -> list[PagedCacheGroupSpec]:
    return [
        PagedCacheGroupSpec.make("full", "full_history", page_size=256),
        PagedCacheGroupSpec.make("sliding", "sliding_window", page_size=128, sliding_window_tokens=511),
        PagedCacheGroupSpec.make(
            "conv", "sliding_window", page_size=8, sliding_window_tokens=12, live_tail_alloc=live_tail
        ),
    ]


class OneRequest:
    """One request prefilled to `context` tokens, ready to decode."""

    def __init__(self, context: int, decode_steps: int, seed: int = 0) -> None:
        total = context + decode_steps + 1
        # enough pages for the whole full-history row plus the sliding/conv tails
        pool = BlockPool(total // 256 + 64 + 64 + 8)
        self.coord = CacheCoordinator(group_specs(), pool)
        self.pool = pool
        rng = np.random.default_rng(seed)
        self.stream = rng.integers(0, 32000, size=total).tolist()
        self.tokens = self.stream[:context]
        self.hasher = PrefixHasher(self.coord.base)
        self.tables = self.coord.new_tables()
        # prefill in 8192-token chunks: publish -> reclaim -> acquire, like the scheduler
        done = 0
        while done < context:
            n = min(8192, context - done)
            self.coord.reclaim(self.tables, done)
            assert self.coord.acquire(self.tables, n)
            done += n
            self.hasher.extend(self.tokens[:done])
            self.coord.publish(self.tables, self.hasher.hashes, done)
        self.computed = context

    def decode(self, steps: int) -> float:
        """Run `steps` decode steps; returns seconds per step."""
        coord, tables, hasher, tokens, stream = self.coord, self.tables, self.hasher, self.tokens, self.stream
        base = coord.base
        computed = self.computed
        t0 = time.perf_counter()
        for _ in range(steps):
            coord.reclaim(tables, computed)  # slid-out slots -> holes
            coord.acquire(tables, 1)  # room for the token being decoded
            computed += 1
            tokens.append(stream[computed])  # the sampled token
            if computed % base == 0:  # a base page completed: hash + publish it
                hasher.extend(tokens)
                coord.publish(tables, hasher.hashes, computed)
        dt = time.perf_counter() - t0
        self.computed = computed
        return dt / steps

    def pinned(self) -> list[int]:
        return [sum(1 for p in t.pages if p) for t in self.tables]


def first_chunk_conv_pages(chunk: int = 8192) -> tuple[int, int]:
    """Conv pages pinned by a fresh `chunk`-token first chunk, with and without live-tail."""
    out = []
    for live_tail in (True, False):
        coord = CacheCoordinator(group_specs(live_tail), BlockPool(4096))
        tables = coord.new_tables()
        assert coord.acquire(tables, chunk)
        out.append(sum(1 for p in tables[2].pages if p))
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short smoke run")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per timing pass")
    ap.add_argument("--passes", type=int, default=None, help="interleaved timing passes")
    args = ap.parse_args()
    steps = args.steps or (512 if args.quick else 2048)
    passes = args.passes or (2 if args.quick else 6)
    block = 128

    # a fresh request per pass, so every pass decodes from exactly the nominal context; inside a
    # pass the contexts take turns every `block` steps (order alternating), so a noisy neighbour
    # on the machine hits all of them alike
    times: dict[int, list[float]] = {c: [] for c in CONTEXTS}
    reqs: dict[int, OneRequest] = {}
    for p in range(passes):
        reqs = {c: OneRequest(c, steps + 1, seed=p) for c in CONTEXTS}
        for b in range(steps // block):
            for c in CONTEXTS if (b + p) % 2 == 0 else CONTEXTS[::-1]:
                times[c].append(reqs[c].decode(block))
    best = {c: min(v) for c, v in times.items()}
    med = {c: statistics.median(v) for c, v in times.items()}

    print(
        f"# cache core: one decode step (acquire + publish + reclaim); {passes} passes x {steps} "
        f"decode steps from the nominal context (fresh request per pass), timed in interleaved "
        f"blocks of {block} steps"
    )
    print(f"# python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}")
    print()
    print(
        "| context | median us/step | best us/step | ratio vs 4k (median) | pinned pages full/sliding/conv |"
    )
    print("|---|---|---|---|---|")
    for c in CONTEXTS:
        pinned = "/".join(str(n) for n in reqs[c].pinned())
        print(
            f"| {c // 1024}k | {med[c] * 1e6:.2f} | {best[c] * 1e6:.2f} | "
            f"{med[c] / med[CONTEXTS[0]]:.2f} | {pinned} |"
        )
    ratio = med[CONTEXTS[-1]] / med[CONTEXTS[0]]
    live, plain = first_chunk_conv_pages()
    print()
    verdict = "OK" if ratio <= 1.2 else "OVER"
    print(f"128k/4k per-step ratio (medians): {ratio:.2f} (target <= 1.2): {verdict}")
    print(
        f"8192-token first chunk, conv group (B=8, W=12): live-tail pins {live} pages, "
        f"plain allocation pins {plain} ({plain / live:.0f}x)"
    )


if __name__ == "__main__":
    main()
