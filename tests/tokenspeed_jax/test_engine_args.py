"""`EngineArgs`: every option once; every field round-trips through the command line."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from tokenspeed_jax.engine_args import (
    CLI_DEFAULTS,
    RESOLVED_BY_LLM,
    EngineArgs,
    add_cli_args,
    cli_fields,
    cli_options,
    cli_platform_defaults,
    detect_platform,
    from_cli,
)

# one value other than the default per field, and the flags that spell it
ROUND_TRIP = {
    "model": ("smollm2-135m", ["--model", "smollm2-135m"]),
    "page_size": (8, ["--page-size", "8"]),
    "num_pages": (300, ["--num-pages", "300"]),
    "kv_cache_memory_bytes": (4 << 30, ["--kv-cache-memory-bytes", "4G"]),
    "max_batch_requests": (7, ["--max-batch-requests", "7"]),
    "max_scheduled_tokens": (96, ["--max-scheduled-tokens", "96"]),
    "max_context_len": (1000, ["--max-context-len", "1000"]),
    "dtype": ("bfloat16", ["--dtype", "bfloat16"]),
    "attention_backend": ("reference", ["--attention-backend", "reference"]),
    "seed": (3, ["--seed", "3"]),
    "kv_cache_dtype": ("int8", ["--kv-cache-dtype", "int8"]),
    "quantization": ("w8a8", ["--quantization", "w8a8"]),
    "enable_prefix_cache": (False, ["--no-prefix-cache"]),
    "tensor_parallel_size": (2, ["--tensor-parallel-size", "2"]),
    "data_parallel_size": (3, ["--data-parallel-size", "3"]),
    "compile_cache_dir": ("/tmp/cc", ["--compile-cache-dir", "/tmp/cc"]),
    "compile_workers": (4, ["--compile-workers", "4"]),
    "lazy_compile": ("sync", ["--lazy-compile", "sync"]),
    "async_scheduling": (False, ["--no-async-scheduling"]),
    "scan_layers": (False, ["--no-scan-layers"]),
    "min_token_bucket": (16, ["--min-token-bucket", "16"]),
    "min_kv_bucket": (64, ["--min-kv-bucket", "64"]),
    "speculative_config": (
        {"method": "ngram", "num_speculative_tokens": 4},
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'],
    ),
    "max_live_requests": (9, ["--max-live-requests", "9"]),
    "max_prefill_chunk_tokens": (128, ["--max-prefill-chunk-tokens", "128"]),
    "decode_reserve_tokens": (0, ["--decode-reserve-tokens", "0"]),
    "enable_adoption": (False, ["--no-adoption"]),
    "conv_page_size": (4, ["--conv-page-size", "4"]),
    "state_page_size": (64, ["--state-page-size", "64"]),
    "honor_full_refresh": (False, ["--no-honor-full-refresh"]),
    "debug_checks": (True, ["--debug-checks"]),
    "gpu_memory_utilization": (0.5, ["--gpu-memory-utilization", "0.5"]),
    "kv_offloading_size": (4.0, ["--kv-offloading-size", "4"]),
    "num_state_pages": (300, ["--num-state-pages", "300"]),
    "state_pool_share": (0.0, ["--state-pool-share", "0"]),
    "weight_layout": ("checkpoint", ["--weight-layout", "checkpoint"]),
}


def _parser(platform: str = "cpu", **defaults) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_cli_args(p, platform=platform, **defaults)
    return p


def test_the_table_covers_every_flag():
    assert set(ROUND_TRIP) == {f.name for f in cli_fields()}
    # distributed has its own flag group (cli.common.add_distributed_args)
    assert {f.name for f in dataclasses.fields(EngineArgs)} - set(ROUND_TRIP) == {"distributed"}


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_every_field_round_trips_through_the_cli(name):
    value, argv = ROUND_TRIP[name]
    assert value != getattr(EngineArgs(), name)
    args = from_cli(_parser().parse_args(argv))
    assert getattr(args, name) == value
    # nothing else moved off the CLI's defaults
    rest = {f.name: getattr(args, f.name) for f in cli_fields() if f.name != name}
    want = {k: cli_platform_defaults("cpu").get(k, getattr(EngineArgs(), k)) for k in rest}
    assert rest == want


def test_cli_defaults_differ_from_llm_only_where_listed():
    args = from_cli(_parser().parse_args([]))
    llm = EngineArgs().for_platform("cpu")
    differ = {f.name for f in cli_fields() if getattr(args, f.name) != getattr(llm, f.name)}
    assert differ == set(CLI_DEFAULTS) | RESOLVED_BY_LLM  # those stay None: LLM resolves them


def test_platform_fields_are_filled_per_platform_and_given_values_stay():
    platform_fields = {f.name for f in dataclasses.fields(EngineArgs) if f.metadata["platform"]}
    assert platform_fields == {"dtype", "max_batch_requests", "max_scheduled_tokens", "scan_layers"}
    assert all(getattr(EngineArgs(), name) is None for name in platform_fields)
    cpu, gpu = EngineArgs().for_platform("cpu"), EngineArgs().for_platform("cuda")
    assert (cpu.dtype, cpu.max_batch_requests, cpu.max_scheduled_tokens) == ("float32", 64, 2048)
    assert (gpu.dtype, gpu.max_batch_requests, gpu.max_scheduled_tokens) == ("auto", 256, 8192)
    assert cpu.scan_layers is True and gpu.scan_layers is False
    assert EngineArgs(scan_layers=False).for_platform("cpu").scan_layers is False
    assert EngineArgs().for_platform("tpu") == gpu  # every accelerator: the GPU table
    given = EngineArgs(dtype="bfloat16", max_batch_requests=8).for_platform("gpu")
    assert (given.dtype, given.max_batch_requests, given.max_scheduled_tokens) == ("bfloat16", 8, 8192)
    # the commands: CPU keeps its smaller steps, a GPU gets the GPU table
    on_gpu = from_cli(_parser("gpu").parse_args([]))
    assert (on_gpu.dtype, on_gpu.max_batch_requests, on_gpu.max_scheduled_tokens) == ("auto", 256, 8192)
    on_cpu = from_cli(_parser("cpu").parse_args([]))
    assert (on_cpu.dtype, on_cpu.max_batch_requests, on_cpu.max_scheduled_tokens) == ("float32", 32, 512)
    assert on_cpu.scan_layers is None and on_gpu.scan_layers is None  # LLM resolves it


@pytest.mark.parametrize(
    "env, want", [("cpu", "cpu"), ("cuda", "gpu"), ("cuda,cpu", "gpu"), ("tpu", "gpu"), ("", "cpu")]
)
def test_detect_platform_reads_jax_platforms(monkeypatch, env, want):
    monkeypatch.setenv("JAX_PLATFORMS", env)
    if not env:  # unset: device nodes + a jax GPU plugin decide; this CPU machine has no node
        monkeypatch.delenv("JAX_PLATFORMS")
        monkeypatch.setattr(os.path, "exists", lambda path: False)
    assert detect_platform() == want


def test_an_llm_resolves_its_platform_defaults_on_its_devices():
    from tokenspeed_jax import LLM

    llm = LLM("tiny-random", num_pages=64, max_context_len=128, compile_cache_dir=False)
    assert (llm.args.dtype, llm.args.max_batch_requests, llm.args.max_scheduled_tokens) == (
        "float32",
        64,
        2048,
    )
    assert llm.dtype == "float32" and llm.step_temp_bytes == 0  # CPU: no memory statistics


def test_a_command_pool_default_yields_to_memory_sizing():
    p = _parser(num_pages=1024)
    assert from_cli(p.parse_args([])).num_pages == 1024
    sized = from_cli(p.parse_args(["--kv-cache-memory-bytes", "1G"]))
    assert (sized.num_pages, sized.kv_cache_memory_bytes) == (None, 1 << 30)
    assert from_cli(p.parse_args(["--num-pages", "77"])).num_pages == 77
    with pytest.raises(ValueError, match="not both"):
        from_cli(p.parse_args(["--num-pages", "77", "--kv-cache-memory-bytes", "1G"]))


def test_no_compile_cache_is_false():
    p = _parser()
    assert cli_options(p.parse_args(["--no-compile-cache"]))["compile_cache_dir"] is False
    assert cli_options(p.parse_args([]))["compile_cache_dir"] is None


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--page-size", "0"], "must be >= 1"),
        (["--dtype", "f8"], "invalid choice"),
        (["--kv-cache-memory-bytes", "lots"], "expected bytes"),
        (["--speculative-config", "[1]"], "bad --speculative-config"),
        (["--lazy-compile", "never"], "invalid choice"),
        (["--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (["--gpu-memory-utilization", "nan"], "must be in (0, 1]"),
        (["--kv-offloading-size", "-1"], "must be >= 0.0"),
        (["--kv-offloading-size", "nan"], "must be >= 0.0"),
        (["--kv-offloading-size", "lots"], "expected a number of GiB"),
        (["--state-pool-share", "1"], "must be in [0, 1)"),
        (["--state-pool-share", "half"], "expected a share like 0.5"),
        (["--num-state-pages", "1"], "must be >= 2"),
    ],
)
def test_bad_flags_are_argparse_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize(
    "options, needle",
    [
        (dict(page_size=0), "page_size must be a positive int, got 0"),
        (dict(seed=-1), "seed must be an int >= 0"),
        (dict(max_batch_requests=True), "max_batch_requests must be a positive int"),
        (dict(dtype="f8"), "dtype must be None or one of"),
        (dict(quantization="int4"), "quantization must be None or one of"),
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype must be one of"),
        (dict(enable_prefix_cache="yes"), "enable_prefix_cache must be True or False"),
        (dict(num_pages=10, kv_cache_memory_bytes=1 << 20), "not both"),
        (dict(quantization="gguf", tensor_parallel_size=2), "one device per replica"),
        (dict(speculative_config={"method": "eagle"}), "method"),
        (dict(pages=10), "unknown LLM options"),
        (dict(gpu_memory_utilization=0.0), r"gpu_memory_utilization must be a fraction in \(0, 1\]"),
        (dict(gpu_memory_utilization="0.9"), "gpu_memory_utilization must be a fraction"),
        (dict(state_pool_share=-0.1), r"state_pool_share must be a share in \[0, 1\)"),
        (dict(num_state_pages=1), "num_state_pages must be an int >= 2"),
    ],
)
def test_bad_options_raise_value_errors_naming_them(options, needle):
    with pytest.raises(ValueError, match=needle):
        EngineArgs.from_options("tiny-random", **options)


def test_every_field_is_documented():
    for f in dataclasses.fields(EngineArgs):
        assert len(f.metadata["help"]) > 10, f.name


def test_preflight_counts_pages_from_the_record_without_a_scheduler():
    from tokenspeed_jax.cli.checks import preflight

    ok = EngineArgs(num_pages=200, max_context_len=512)
    assert preflight(ok, longest_request=None) is None
    small = EngineArgs(num_pages=20, max_context_len=512)
    problem = preflight(small, longest_request=None)
    assert problem is not None and "--num-pages 20" in problem
    assert "--max-context-len 512" in preflight(ok, longest_request=600)


def test_preflight_counts_a_state_pool_apart():
    """tiny-hybrid with --num-state-pages: the attention pages are checked against --num-pages
    and the state snapshots against --num-state-pages, each naming its own flag."""
    from tokenspeed_jax.cli.checks import preflight

    kw = dict(model="tiny-hybrid", max_context_len=512, max_scheduled_tokens=64, page_size=16)
    # alone: 32 attention pages; 1 + 4 + 2 = 7 state pages (resume, a 64-token chunk, two edges)
    assert preflight(EngineArgs(num_pages=33, num_state_pages=8, **kw), longest_request=None) is None
    problem = preflight(EngineArgs(num_pages=32, num_state_pages=8, **kw), longest_request=None)
    assert problem is not None and problem.startswith("--num-pages 32: a 512-token request needs 33")
    problem = preflight(EngineArgs(num_pages=33, num_state_pages=7, **kw), longest_request=None)
    assert problem is not None and problem.startswith("--num-state-pages 7: a 512-token request needs 8")
    assert preflight(EngineArgs(num_pages=33, **kw), longest_request=None) is not None  # one pool: 39
