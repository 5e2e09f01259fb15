"""Multi-process serving: two local processes (gloo, 2 virtual CPU devices each) on 127.0.0.1.

The processes are this file run with `--worker ROLE PROCESS_ID PORT OUT` (`XLA_FLAGS` gives each
process 2 devices, so the global mesh has 4). One pair runs, in order, on the same two processes:

1. tp=4 across both processes (tiny-random has 2 KV heads, so KV heads are replicated too):
   greedy tokens == the leader's own single-device run, |logprob diff| <= 1e-4 (generated and
   prompt logprobs); a request aborted mid-flight ends "abort" with a prefix of its single-device
   tokens while the others finish unchanged, and no page leaks; at most one compile per shape key.
2. tp=2 x dp=2 (each replica spans both processes): same checks, and both replicas had a step
   in flight at once (they overlap); then the leader serves HTTP and the openai client (httpx
   when openai is missing) gets the single-device completion.
3. clean shutdown: the leader's `shutdown()` releases the follower; both exit 0.

0. (with torch + transformers) a real family: the tiny qwen3 checkpoint of tests/hf, tp=4.

A second pair runs the real launch path, `tokenspeed-jax serve --coordinator ... --process-id I`:
the leader answers a completion, then a SIGKILLed follower (mid-request) makes the leader exit
with the clear message and `EXIT_FOLLOWER_LOST` within a bounded time. Every child is killed in
a `finally`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.slow  # `pytest -m "not slow"` skips it in the inner loop; CI runs it

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# one token bucket (16) keeps compiles - the slow part on 2 shared cores - to one per replica
SMALL = dict(
    page_size=4,
    num_pages=96,
    max_batch_requests=4,
    max_scheduled_tokens=16,
    min_token_bucket=16,  # no 1-token bucket on CPU besides
    max_context_len=64,
    attention_backend="reference",
)
PAIR_TIMEOUT_S = 420
KILL_BOUND_S = 30  # follower_timeout_s=3 plus slack for a loaded machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(role: str, pid: int, port: int, out: str, hf_path: str = "-") -> subprocess.Popen:
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu", PYTHONPATH=ROOT
    )
    return subprocess.Popen(
        [sys.executable, "-u", __file__, "--worker", role, str(pid), str(port), out, hf_path],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


# ---------------------------------------------------------------------------------- workers
def _dist(pid: int, port: int, **kw) -> dict:
    # a short keep-alive so that idle gaps (HTTP start-up, phase changes) really send some
    kw.setdefault("keepalive_s", 0.5)
    return dict(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=pid, **kw)


def _workload():
    import numpy as np

    from tokenspeed_jax import SamplingParams

    rng = np.random.default_rng(0)
    system = rng.integers(0, 256, 9).tolist()
    prompts = [system + rng.integers(0, 256, int(rng.integers(2, 12))).tolist() for _ in range(5)]
    gen = SamplingParams(max_tokens=10, logprobs=True, ignore_eos=True)
    plp = SamplingParams(max_tokens=3, logprobs=True, prompt_logprobs=True, ignore_eos=True)
    return prompts, gen, plp


def _generate(llm) -> dict:
    prompts, gen, plp = _workload()
    outs = llm.generate(prompts, gen) + llm.generate(prompts[:2], plp)
    return {
        "tokens": [o.token_ids for o in outs],
        "logprobs": [o.logprobs for o in outs],
        "prompt_logprobs": [o.prompt_logprobs for o in outs],
    }


def _abort_midflight(llm) -> dict:
    """Three requests; the second is aborted after 3 steps; the rest run to completion."""
    from tokenspeed_jax import SamplingParams

    prompts, _, _ = _workload()
    eng = llm.engine
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    rids = [eng.add_request(p, sp, f"ab-{i}") for i, p in enumerate(prompts[:3])]
    outs = {}
    for _ in range(3):
        outs.update({o.request_id: o for o in eng.step()})
    aborted = eng.abort(rids[1])
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    outs[rids[1]] = aborted
    st = llm.stats()
    return {
        "tokens": [outs[r].token_ids for r in rids],
        "reasons": [outs[r].finish_reason for r in rids],
        "free_pages": st["free_pages"],
        "total_pages": st["total_pages"],
    }


def _http(llm) -> dict:
    """Serve `llm` on the leader and ask for one greedy completion of token ids."""
    import uvicorn

    from tokenspeed_jax.server.app import build_app

    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(llm, model_name="tiny-random"), host="127.0.0.1", port=port, log_level="warning"
        )
    )
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    prompt = _workload()[0][0]
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert th.is_alive() and time.monotonic() < deadline, "the server never started"
            time.sleep(0.05)
        try:
            import openai

            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
            resp = client.completions.create(
                model="tiny-random", prompt=prompt, max_tokens=6, temperature=0.0
            )
            text, via = resp.choices[0].text, "openai"
        except ImportError:
            import httpx

            resp = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                timeout=120,
                json={"model": "tiny-random", "prompt": prompt, "max_tokens": 6, "temperature": 0.0},
            )
            resp.raise_for_status()
            text, via = resp.json()["choices"][0]["text"], "httpx"
    finally:
        server.should_exit = True
        th.join(timeout=30)
    return {"text": text, "via": via, "prompt": prompt}


def _hf_phase(pid: int, port: int, path: str) -> dict | None:
    """A real family (tiny qwen3 checkpoint from tests/hf): tp=4 across both processes vs the
    leader's single-device run. Skipped (None) when the parent could not build it."""
    if path == "-":
        return None
    from tokenspeed_jax import LLM
    from tokenspeed_jax.runtime import param_sources

    kw = dict(SMALL, max_context_len=48)
    param_sources.reset_stats()
    llm = LLM(path, tensor_parallel_size=4, distributed=_dist(pid, port), **kw)
    read = {"stats": dict(param_sources.READ_STATS), "total": _checkpoint_bytes(path)}
    if pid:
        return {"steps": llm.run_follower(leave_runtime=False), "read": read}
    got = _generate(llm)
    llm.shutdown(leave_runtime=False)
    return {"base": _generate(LLM(path, **kw)), "tp4": got, "read": read}


def _checkpoint_bytes(path: str) -> int:
    """Bytes of every tensor in the checkpoint's safetensors files."""
    from safetensors import safe_open

    from tokenspeed_jax.hf.weights import checkpoint_files

    total = 0
    for name, file in checkpoint_files(path).items():
        with safe_open(file, framework="numpy") as f:
            total += f.get_tensor(name).nbytes
    return total


def _held_bytes(llm) -> list[int]:
    """[bytes of the parameter shards on this process's devices, bytes of the whole model]."""
    import jax

    leaves = jax.tree.leaves(llm.engine.runner.params)
    return [sum(s.data.nbytes for x in leaves for s in x.addressable_shards), sum(x.nbytes for x in leaves)]


def _leader_main(port: int, hf_path: str) -> dict:
    from tokenspeed_jax import LLM, SamplingParams

    out: dict = {"hf": _hf_phase(0, port, hf_path)}
    from tokenspeed_jax.runtime import param_sources

    t0 = time.perf_counter()
    param_sources.reset_stats()
    llm = LLM("tiny-random", tensor_parallel_size=4, distributed=_dist(0, port), **SMALL)
    out["build_s"] = time.perf_counter() - t0
    out["tiny_generated"] = [param_sources.READ_STATS[f"generated_{k}_bytes"] for k in ("output", "temp")]
    out["tiny_held"] = _held_bytes(llm)
    base = LLM("tiny-random", **SMALL)  # single device: this process's first local device
    out["base"] = _generate(base)
    out["base_abort"] = _abort_midflight(base)
    prompt = _workload()[0][0]
    out["base_text"] = base.generate([prompt], SamplingParams(max_tokens=6))[0].text

    t0 = time.perf_counter()
    out["tp4"] = _generate(llm)
    out["tp4_s"] = time.perf_counter() - t0
    out["tp4_abort"] = _abort_midflight(llm)
    runner = llm.engine.runner
    k = runner.state.caches[0]["k"]
    out["tp4_pool"] = [
        list(k.shape),
        [list(s.data.shape) for s in k.addressable_shards],
        len(k.sharding.device_set),
    ]
    out["tp4_compiles"] = runner.num_compiles
    out["tp4_shape_keys"] = len(runner.shape_keys)
    llm.shutdown(leave_runtime=False)  # the follower builds the next LLM too

    # the overlapped engine loop on the leader: its dispatches must reach the followers too
    llm = LLM(
        "tiny-random",
        tensor_parallel_size=2,
        data_parallel_size=2,
        distributed=_dist(0, port),
        async_scheduling=True,
        **SMALL,
    )
    out["tp2dp2"] = _generate(llm)
    out["tp2dp2_overlapped"] = llm._group.overlapped  # steps started while the other computed
    out["tp2dp2_abort"] = _abort_midflight(llm)
    out["tp2dp2_steps"] = [e.num_steps for e in llm.engines]
    out["tp2dp2_devices"] = [
        sorted((d.process_index, d.id) for d in e.runner.state.mirrors[0].sharding.device_set)
        for e in llm.engines
    ]
    out["http"] = _http(llm)
    deadline = time.monotonic() + 30  # idle: the keep-alive broadcasts (every 0.5 s)
    while llm._group.noops == 0:
        assert time.monotonic() < deadline, "an idle leader sent no keep-alive in 30 s"
        time.sleep(0.05)
    llm.shutdown()
    out["noops"] = llm._group.noops  # after shutdown: no keep-alive can follow
    out["shutdown"] = True
    return out


def _running(http_port: int) -> bool:
    """Whether the leader's server reports a running request (its Prometheus gauge)."""
    import re

    import httpx

    text = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=5).text
    return any(
        float(v) >= 1
        for v in re.findall(r"^tokenspeed_num_requests_running(?:\{[^}]*\})? (\S+)$", text, re.M)
    )


def _follower_main(port: int, hf_path: str) -> dict:
    from tokenspeed_jax import LLM

    hf = _hf_phase(1, port, hf_path)
    llm = LLM("tiny-random", tensor_parallel_size=4, distributed=_dist(1, port), **SMALL)
    held = _held_bytes(llm)
    steps = [llm.run_follower(leave_runtime=False)]
    llm = LLM(
        "tiny-random", tensor_parallel_size=2, data_parallel_size=2, distributed=_dist(1, port), **SMALL
    )
    steps.append(llm.run_follower())
    return {"steps": steps, "noops": llm._group.noops, "hf": hf, "tiny_held": held}


# ---------------------------------------------------------------------------------- tests
def _qwen3_checkpoint(root) -> str:
    """The tiny qwen3 checkpoint of tests/hf (built by transformers), or "-" without torch."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return "-"
    from tests.hf.checkpoints import build_checkpoint, family_configs

    path = str(root / "qwen3")
    build_checkpoint("qwen3", family_configs()["qwen3"], path)
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("dist")
    hf_path = _qwen3_checkpoint(tmp)
    port = _free_port()
    outs = [str(tmp / f"p{i}.json") for i in range(2)]
    procs = []
    t0 = time.perf_counter()
    try:
        procs = [_spawn("main", i, port, outs[i], hf_path) for i in range(2)]
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=PAIR_TIMEOUT_S)[0])
            except subprocess.TimeoutExpired:
                _kill(procs)
                pytest.fail(f"the two-process run exceeded {PAIR_TIMEOUT_S}s")
        for i, p in enumerate(procs):
            assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{logs[i][-4000:]}"
        leader, follower = (json.loads(pathlib.Path(o).read_text()) for o in outs)
    finally:
        _kill(procs)
    leader["follower"] = follower
    leader["wall_s"] = time.perf_counter() - t0
    return leader


@pytest.mark.parametrize("name", ["tp4", "tp2dp2"])
def test_two_processes_match_single_device(pair, name, max_logprob_diff):
    base, got = pair["base"], pair[name]
    assert got["tokens"] == base["tokens"]
    assert max_logprob_diff(got["logprobs"], base["logprobs"]) <= 1e-4
    assert max_logprob_diff(got["prompt_logprobs"], base["prompt_logprobs"]) <= 1e-4


@pytest.mark.parametrize("name", ["tp4_abort", "tp2dp2_abort"])
def test_abort_mid_flight(pair, name):
    base, got = pair["base_abort"], pair[name]
    assert got["reasons"] == ["length", "abort", "length"]
    assert got["tokens"][0] == base["tokens"][0] and got["tokens"][2] == base["tokens"][2]
    cut = got["tokens"][1]
    assert 0 < len(cut) < 10 and cut == base["tokens"][1][: len(cut)]
    assert got["free_pages"] == got["total_pages"]  # nothing leaked


def test_global_mesh_layout(pair):
    # tp=4 over 2 processes x 2 devices, 2 KV heads replicated to one per shard
    shape, shards, ndev = pair["tp4_pool"]
    assert ndev == 4 and shape[2] == 4 and shards == [[shape[0], shape[1], 1, shape[3]]] * 2
    # tp=2 x dp=2: every replica spans both processes
    assert pair["tp2dp2_devices"] == [[[0, 0], [1, 2048]], [[0, 1], [1, 2049]]]
    assert all(s > 0 for s in pair["tp2dp2_steps"])
    # some step of one replica started while the other replica's step was still computing
    assert pair["tp2dp2_overlapped"] > 0
    print(
        f"tp2dp2: {pair['tp2dp2_overlapped']} of {sum(pair['tp2dp2_steps'])} steps overlapped "
        f"the other replica's"
    )
    assert 1 <= pair["tp4_compiles"] <= pair["tp4_shape_keys"]  # at most one per shape key


def test_http_on_leader(pair):
    http = pair["http"]
    assert http["text"] == pair["base_text"] and http["text"]
    print(f"HTTP completion via {http['via']}")


def test_real_family_two_processes(pair, max_logprob_diff):
    """Tiny qwen3 checkpoint (2 KV heads, sliding layers), tp=4 across the two processes."""
    if pair["hf"] is None:
        pytest.skip("torch / transformers (the 'hf' extra) not installed: no qwen3 checkpoint")
    base, got = pair["hf"]["base"], pair["hf"]["tp4"]
    assert got["tokens"] == base["tokens"]
    assert max_logprob_diff(got["logprobs"], base["logprobs"]) <= 1e-4
    assert max_logprob_diff(got["prompt_logprobs"], base["prompt_logprobs"]) <= 1e-4


def test_each_process_loads_only_its_shards(pair):
    """tp=4 over 2 processes x 2 devices: each process reads about half of the checkpoint (its two
    shards of every sharded tensor, each KV head it holds once, the small replicated norms) and
    holds half of the tiny model's parameters; the tokens are checked above."""
    held, f_held = pair["tiny_held"], pair["follower"]["tiny_held"]
    for mine, whole in (held, f_held):
        assert 0.45 * whole <= mine <= 0.6 * whole, (mine, whole)
    print(
        f"tiny-random tp=4: process 0 holds {held[0]} of {held[1]} parameter bytes, process 1 "
        f"{f_held[0]}; generator program per device: XLA output, temp bytes {pair['tiny_generated']}"
    )
    if pair["hf"] is None:
        pytest.skip("torch / transformers (the 'hf' extra) not installed: no qwen3 checkpoint")
    reads = [pair["hf"]["read"], pair["follower"]["hf"]["read"]]
    for pid, r in enumerate(reads):
        got, total = r["stats"]["checkpoint_bytes"], r["total"]
        assert r["stats"]["whole_tensor_bytes"] == 0
        assert 0.45 * total <= got <= 0.6 * total, (pid, got, total)
        print(f"qwen3 tp=4: process {pid} read {got} of {total} checkpoint bytes ({got / total:.3f})")


def test_clean_shutdown(pair):
    assert pair["shutdown"]
    steps = pair["follower"]["steps"]
    assert len(steps) == 2 and all(s > 0 for s in steps)  # both LLMs replayed steps, then exited 0
    assert pair["follower"]["noops"] == pair["noops"] > 0  # idle keep-alives, in step order
    print(
        f"two-process run: {pair['wall_s']:.1f}s wall, leader build {pair['build_s']:.1f}s, "
        f"tp4 generate {pair['tp4_s']:.1f}s"
    )


def _spawn_serve(pid: int, port: int, http_port: int) -> subprocess.Popen:
    """`tokenspeed-jax serve` as process `pid` of a two-process run (the real launch path)."""
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu", PYTHONPATH=ROOT
    )
    flags = [
        "--tensor-parallel-size",
        "4",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        "--process-id",
        str(pid),
        "--follower-timeout",
        "5",
        "--port",
        str(http_port),
        "--model",
        "tiny-random",
    ]
    for key, value in SMALL.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "tokenspeed_jax.cli", "serve", *flags],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_cli_serve_then_killed_follower_fails_leader_loudly(pair):
    """`serve` on two processes answers a completion on the leader; then the follower is
    SIGKILLed while the leader is mid-request, and the leader exits with EXIT_FOLLOWER_LOST and
    the clear message within KILL_BOUND_S."""
    httpx = pytest.importorskip("httpx")
    from tokenspeed_jax.distributed.launch import EXIT_FOLLOWER_LOST

    port, http_port = _free_port(), _free_port()
    url = f"http://127.0.0.1:{http_port}/v1/completions"
    prompt = pair["http"]["prompt"]
    procs = []
    try:
        procs = [_spawn_serve(i, port, http_port) for i in range(2)]
        leader, follower = procs
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(leader.stdout), daemon=True)
        reader.start()
        deadline = time.monotonic() + PAIR_TIMEOUT_S
        while True:
            assert leader.poll() is None, "".join(lines)[-3000:]
            assert time.monotonic() < deadline, "the leader's server never came up"
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 6, "temperature": 0.0}
        resp = httpx.post(url, json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == pair["base_text"]
        # keep the leader busy stepping, then kill the follower under it
        long = dict(body, max_tokens=40)

        def busy():
            with contextlib.suppress(httpx.HTTPError):  # the leader dies under this request
                httpx.post(url, json=long, timeout=60)

        threading.Thread(target=busy, daemon=True).start()
        deadline = time.monotonic() + 60  # the long request is running before the kill
        while not _running(http_port):
            assert time.monotonic() < deadline, "the long request never started running"
            time.sleep(0.05)
        follower.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rc = leader.wait(timeout=KILL_BOUND_S)
        elapsed = time.monotonic() - t0
        reader.join(timeout=5)
    finally:
        _kill(procs)
    log = "".join(lines)
    assert rc == EXIT_FOLLOWER_LOST, log[-3000:]
    assert "follower process 1 of 2 stopped responding" in log
    print(f"leader exited {elapsed:.1f}s after the follower was killed")


if __name__ == "__main__" and "--worker" in sys.argv:
    sys.path.insert(0, ROOT)
    _, _pid, _port, _out, _hf = sys.argv[sys.argv.index("--worker") + 1 :][:5]
    _pid, _port = int(_pid), int(_port)
    _res = _leader_main(_port, _hf) if _pid == 0 else _follower_main(_port, _hf)
    with open(_out, "w") as _f:
        json.dump(_res, _f)
