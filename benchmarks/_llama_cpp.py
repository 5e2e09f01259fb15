"""llama.cpp (llama-cpp-python) as the batch-1 GGUF peer (issue 26): the same GGUF file, the
same prompt ids, greedy, EOS banned, timed in its own process the way ours is timed.

How to build it on these machines: ../shared/peers/llama-cpp.md (`--llama-python` is that
venv's python). No such interpreter, or no llama_cpp in it: `batch1_tok_s` returns None.
"""

from __future__ import annotations

import os

# argv[1] = JSON {gguf, prompt, max_tokens, reps, threads}; prints "RESULT {tok_s, tokens}".
_CHILD = r"""
import json, sys, time
from llama_cpp import Llama

kw = json.loads(open(sys.argv[1]).read())
llm = Llama(model_path=kw["gguf"], n_ctx=2048, n_threads=kw["threads"], n_batch=512,
            verbose=False, seed=0)
eos = llm.token_eos()

def run():
    out = llm.create_completion(kw["prompt"], max_tokens=kw["max_tokens"], temperature=0.0,
                                top_k=1, logit_bias={eos: -1e9})
    return out
run()  # warm: loads the pages, fills the prompt's KV (reused by the timed runs, as ours is)
best, toks = 1e9, None
for _ in range(kw["reps"]):
    t = time.perf_counter()
    out = run()
    best = min(best, time.perf_counter() - t)
    toks = out["usage"]["completion_tokens"]
print("RESULT " + json.dumps({"tok_s": toks / best, "tokens": toks}), flush=True)
"""


def batch1_tok_s(
    python: str | None,
    gguf: str,
    prompt: list[int],
    max_tokens: int,
    reps: int = 2,
    threads: int | None = None,
) -> float | None:
    """Best-of-`reps` tok/s of one greedy request of `prompt` ids through llama.cpp (wall time
    of the call after a warm one, as benchmarks/quantization.py times ours), or None."""
    if not python or not os.path.exists(python):
        return None
    kw = dict(
        gguf=os.path.abspath(gguf),
        prompt=prompt,
        max_tokens=max_tokens,
        reps=reps,
        threads=threads or os.cpu_count() or 1,
    )
    from _peer import run_child  # benchmarks/ is sys.path[0] when run as a script

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = run_child(python, _CHILD, kw, env, "llama.cpp")
    return None if res is None else float(res["tok_s"])
