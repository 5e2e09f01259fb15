"""A minimal policy-gradient loop: a JAX trainer and the engine in one process (issue 48).

Each iteration: generate rollouts with `LLM` (sampled, temperature 1), score them, take one
REINFORCE step (group-mean baseline) on the trainer's Flax `CausalLM`, and hand the new params
to `llm.update_weights` as they are: the trainer's `nnx.State`, jax arrays on the same device,
no host copy and no checkpoint. Every output carries the `weight_version` of the policy that
sampled it, so stale rollouts would be easy to spot.

The task: the built-in tiny model (random weights, byte-level vocabulary) is rewarded for the
share of its generated tokens that are lowercase vowels ("aeiou"); the reward rises within a
few dozen steps. Needs optax (`pip install -e .[rl]`).

    JAX_PLATFORMS=cpu python examples/rl_loop.py --steps 30
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.models import registry

TARGET = np.array([ord(c) for c in "aeiou"])


def reward(token_ids: list[int]) -> float:
    """Share of the generated tokens that are lowercase vowels."""
    return float(np.isin(token_ids, TARGET).mean())


def main() -> None:
    import optax

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rollouts", type=int, default=16, help="samples per step")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    seed = 0
    # weight_layout="checkpoint": the engine keeps the trainer's layout, so each handoff shares the
    # new arrays instead of re-laying them for the native CPU matmul (docs/rl.md)
    llm = LLM("tiny-random", seed=seed, num_pages=256, max_batch_requests=args.rollouts, max_context_len=128,
              weight_layout="checkpoint")  # fmt: skip
    # the trainer's copy of the same policy: the built-in model of the same seed
    graphdef, params, rest = nnx.split(registry.load_builtin("tiny-random", seed=seed)[1], nnx.Param, ...)
    opt = optax.adam(args.lr)
    opt_state = opt.init(params)
    prompt = list(b"Say something: ")
    p_len = len(prompt)

    def loss_fn(params, seqs, adv):
        """REINFORCE: -mean(advantage * log p(generated tokens)); seqs i32[N, P + G], adv f32[N]."""
        model = nnx.merge(graphdef, params, rest)
        logits = jax.vmap(model.dense)(seqs[:, :-1])  # [N, P + G - 1, V]
        logp = jax.nn.log_softmax(logits, axis=-1)
        taken = jnp.take_along_axis(logp, seqs[:, 1:, None], axis=-1)[..., 0]
        gen_logp = taken[:, p_len - 1 :].sum(axis=1)  # the generated tokens only
        return -(adv * gen_logp).mean()

    @jax.jit
    def train_step(params, opt_state, seqs, adv):
        loss, grads = jax.value_and_grad(loss_fn)(params, seqs, adv)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    print(f"{'step':>4} {'reward':>7} {'version':>7} {'generate s':>10} {'train s':>8} {'handoff s':>9}")
    for step in range(args.steps):
        t0 = time.perf_counter()
        sp = [
            SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=step * 1000 + i, ignore_eos=True)
            for i in range(args.rollouts)
        ]
        outs = llm.generate([prompt] * args.rollouts, sp)
        t1 = time.perf_counter()
        rewards = np.array([reward(o.token_ids) for o in outs])
        assert {o.weight_version for o in outs} == {llm.weight_version}
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        seqs = jnp.asarray([prompt + o.token_ids for o in outs], jnp.int32)
        params, opt_state, _ = train_step(params, opt_state, seqs, jnp.asarray(adv, jnp.float32))
        jax.block_until_ready(params)
        t2 = time.perf_counter()
        info = llm.update_weights(params)  # the trainer's nnx.State, as it is
        t3 = time.perf_counter()
        print(
            f"{step:>4} {rewards.mean():>7.3f} {outs[0].weight_version:>7} {t1 - t0:>10.2f} "
            f"{t2 - t1:>8.2f} {t3 - t2:>9.3f}",
            flush=True,
        )
        assert info["weight_version"] == step + 1


if __name__ == "__main__":
    main()
