"""Step 5: transformers on the same checkpoint and prompts (bf16, on the GPU when torch sees
one), against step 2's saved outputs.

Teacher-forced on our sequence (prompt + our greedy tokens), one forward: at every generated
position, whether transformers' argmax is our token (greedy agreement per position, immune to
a divergence earlier on) and |our logprob - its logprob| of our token; the same for the prompt
logprobs. Then transformers' own greedy `generate`: how many leading tokens equal ours.
"""

from __future__ import annotations

import json
import time

import common  # noqa: F401  (sys.path)
from common import CKPT, OURS_JSON, result


def main() -> None:
    import numpy as np
    import torch
    import transformers as tr

    with open(OURS_JSON) as f:
        ours = json.load(f)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model = tr.AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.bfloat16).to(dev).eval()
    load_s = time.perf_counter() - t0
    agree, dlp, dplp, lead = [], [], [], []
    for prompt, toks, lps, plps in zip(
        ours["prompts"], ours["tokens"], ours["logprobs"], ours["prompt_logprobs"]
    ):
        seq = torch.tensor([prompt + toks], device=dev)
        with torch.no_grad():
            logp = torch.log_softmax(model(seq).logits[0].float(), -1).cpu().numpy()
        n = len(prompt)
        for j, (t, lp) in enumerate(zip(toks, lps)):
            row = logp[n - 1 + j]
            agree.append(int(row.argmax()) == t)
            dlp.append(abs(lp - float(row[t])))
        for j in range(1, n):
            dplp.append(abs(plps[j] - float(logp[j - 1][prompt[j]])))
        with torch.no_grad():
            gen = model.generate(
                seq[:, :n], max_new_tokens=len(toks), min_new_tokens=len(toks), do_sample=False
            )
        theirs = gen[0, n:].tolist()
        lead.append(next((k for k, (a, b) in enumerate(zip(theirs, toks)) if a != b), len(toks)) / len(toks))
    result(
        "5_transformers",
        device=dev,
        transformers=tr.__version__,
        load_s=load_s,
        greedy_agreement=float(np.mean(agree)),
        mean_abs_dlogprob=float(np.mean(dlp)),
        max_abs_dlogprob=float(np.max(dlp)),
        prompt_mean_abs_dlogprob=float(np.mean(dplp)),
        generate_leading_match=float(np.mean(lead)),
    )


if __name__ == "__main__":
    main()
