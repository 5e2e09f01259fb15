"""CLI: argument errors are one line with exit status 2, before any model loads; --version."""

from __future__ import annotations

import pytest

from tokenspeed_jax import cli


@pytest.fixture(autouse=True)
def no_loading(monkeypatch):
    def boom(*_a, **_k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("tokenspeed_jax.llm.LLM", boom)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["run", "--num-pages", "3"], "--num-pages 3"),
        (["run", "--dtype", "foo"], "--dtype"),
        (["run", "--sessions", "0"], "--sessions"),
        (["run", "--page-size", "x"], "--page-size"),
        (["run", "--max-context-len", "100"], "exceeds --max-context-len 100"),
        (["serve", "--model", "no/such/model"], "--model"),
        (["serve", "--num-pages", "3"], "--num-pages 3"),
        (["serve", "--port", "70000"], "--port"),
        (["serve", "--data-parallel-size", "0"], "--data-parallel-size"),
        (["warmup", "--no-compile-cache"], "drop --no-compile-cache"),
        (["warmup", "--num-pages", "3"], "--num-pages 3"),
        (["serve", "--kv-cache-memory-bytes", "0"], "--kv-cache-memory-bytes"),
        (["serve", "--kv-cache-memory-bytes", "4X"], "--kv-cache-memory-bytes"),
        (["run", "--kv-offloading-size", "-2"], "--kv-offloading-size"),
        (["run", "--num-pages", "64", "--kv-cache-memory-bytes", "1G"], "not both"),
    ],
)
def test_bad_arguments_one_line_exit_2_before_loading(capsys, argv, needle):
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0] and "error:" in err[0], err


def test_version_and_help_show_real_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("tokenspeed-jax ")
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 1024)" in out and "(default: None)" not in out and "sized from device memory" not in out
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    assert "sized from device memory" in " ".join(capsys.readouterr().out.split())


SPEC_JSON = '{"num_speculative_tokens": 3}'


@pytest.mark.parametrize(
    "argv,key,want",
    [
        (["run", "--scan-layers"], "scan_layers", True),
        (["run"], "scan_layers", None),  # LLM decides: on for one CPU device
        (["run", "--no-scan-layers"], "scan_layers", False),
        (["serve", "--scan-layers"], "scan_layers", True),
        (["run"], "speculative_config", None),
        (["run", "--speculative-config", SPEC_JSON], "speculative_config", {"num_speculative_tokens": 3}),
        (["serve", "--speculative-config", SPEC_JSON], "speculative_config", {"num_speculative_tokens": 3}),
        (["run"], "kv_cache_dtype", "auto"),
        (["serve", "--kv-cache-dtype", "fp8_e4m3"], "kv_cache_dtype", "fp8_e4m3"),
        (["run", "--quantization", "w8a8"], "quantization", "w8a8"),
        (["run"], "num_pages", 1024),
        (["serve"], "num_pages", None),
        (["serve", "--kv-cache-memory-bytes", "4G"], "kv_cache_memory_bytes", 4 << 30),
        (["serve", "--kv-cache-memory-bytes", "1.5g"], "kv_cache_memory_bytes", 1_500_000_000),
        (["run", "--kv-cache-memory-bytes", "4096"], "kv_cache_memory_bytes", 4096),
        (["run", "--kv-cache-memory-bytes", "1M"], "num_pages", None),  # the bytes size the pool
    ],
)
def test_engine_flag_reaches_llm(monkeypatch, argv, key, want):
    seen = {}

    class Loaded(Exception):
        pass

    def fake_llm(*_a, **kw):
        seen.update(kw)
        raise Loaded

    monkeypatch.setattr("tokenspeed_jax.llm.LLM", fake_llm)
    with pytest.raises(Loaded):
        cli.main(argv)
    assert seen[key] == want and type(seen[key]) is type(want)


@pytest.mark.parametrize(
    "argv,env,want",
    [
        (
            ["serve"],
            None,
            dict(
                api_keys=[],
                metrics_require_key=False,
                max_request_bytes=8 * 1024 * 1024,
                max_queued_requests=None,
                request_timeout_s=None,
                shutdown_grace_s=30.0,
            ),
        ),
        (
            [
                "serve",
                "--api-key",
                "sk-aaa1",
                "--api-key",
                "sk-bbb2",
                "--metrics-require-key",
                "--max-request-bytes",
                "1000",
                "--max-queued-requests",
                "4",
                "--request-timeout-s",
                "2.5",
                "--shutdown-grace-s",
                "0",
            ],
            "env-key",
            dict(
                api_keys=["sk-aaa1", "sk-bbb2"],
                metrics_require_key=True,
                max_request_bytes=1000,
                max_queued_requests=4,
                request_timeout_s=2.5,
                shutdown_grace_s=0.0,
            ),
        ),
        (["serve"], "env-key", dict(api_keys=["env-key"])),
    ],
)
def test_serve_auth_and_limit_flags_reach_build_app(monkeypatch, caplog, argv, env, want):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import types

    from tokenspeed_jax.cli import commands
    from tokenspeed_jax.server import drain, limits

    assert commands.DEFAULT_MAX_REQUEST_BYTES == limits.DEFAULT_MAX_REQUEST_BYTES
    assert commands.DEFAULT_SHUTDOWN_GRACE_S == drain.DEFAULT_SHUTDOWN_GRACE_S
    if env is None:
        monkeypatch.delenv("TOKENSPEED_JAX_API_KEY", raising=False)
    else:
        monkeypatch.setenv("TOKENSPEED_JAX_API_KEY", env)
    seen = {}
    monkeypatch.setattr(commands, "checked_llm", lambda *_a, **_k: (types.SimpleNamespace(is_leader=True), 0))
    monkeypatch.setattr("tokenspeed_jax.server.app.build_app", lambda llm, **kw: seen.update(kw) or "app")
    monkeypatch.setattr(drain, "serve", lambda app, host, port: seen.update(app=app))
    caplog.set_level("INFO")
    assert cli.main(argv) == 0
    assert seen["app"] == "app" and {k: seen[k] for k in want} == want
    for key in seen["api_keys"]:  # the count is logged, never a key
        assert key not in caplog.text
    assert "authentication:" in caplog.text


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["serve", "--max-request-bytes", "0"], "--max-request-bytes"),
        (["serve", "--max-queued-requests", "-1"], "--max-queued-requests"),
        (["serve", "--request-timeout-s", "0"], "--request-timeout-s"),
        (["serve", "--shutdown-grace-s", "-1"], "--shutdown-grace-s"),
    ],
)
def test_bad_limit_flags(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_choices_match_the_runtime():
    """engine_args keeps a jax-free copy of the kernels' KV cache dtypes (pallas_kernels imports
    only jax); the other lists the runtime imports from it."""
    from pallas_kernels.kv_quant import KV_CACHE_DTYPES
    from tokenspeed_jax import engine_args
    from tokenspeed_jax.models.quant import WEIGHT_QUANTIZATIONS
    from tokenspeed_jax.runtime.backends import BACKENDS
    from tokenspeed_jax.runtime.prepare import WEIGHT_LAYOUTS

    assert engine_args.ATTENTION_BACKENDS == BACKENDS
    assert engine_args.WEIGHT_LAYOUTS == WEIGHT_LAYOUTS
    assert engine_args.KV_CACHE_DTYPES == KV_CACHE_DTYPES
    assert engine_args.WEIGHT_QUANTIZATIONS == WEIGHT_QUANTIZATIONS
