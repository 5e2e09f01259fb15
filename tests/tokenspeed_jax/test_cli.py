"""CLI: argument errors are one line with exit status 2, before any model loads; --version."""

from __future__ import annotations

import pytest

from tokenspeed_jax import cli


@pytest.fixture(autouse=True)
def no_loading(monkeypatch):
    def boom(*_a, **_k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("tokenspeed_jax.llm.LLM", boom)


@pytest.mark.parametrize("argv,needle", [
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
])
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



@pytest.mark.parametrize("argv,want", [(["run", "--scan-layers"], True), (["run"], False),
                                       (["serve", "--scan-layers"], True)])
def test_scan_layers_flag_reaches_llm(monkeypatch, argv, want):
    seen = {}

    class Loaded(Exception):
        pass

    def fake_llm(*_a, **kw):
        seen.update(kw)
        raise Loaded

    monkeypatch.setattr("tokenspeed_jax.llm.LLM", fake_llm)
    with pytest.raises(Loaded):
        cli.main(argv)
    assert seen["scan_layers"] is want
