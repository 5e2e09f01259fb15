"""The `tokenspeed-jax` command line: `commands` (the subcommands and `main`), `common` (shared
flags and the `LLM` builder), `checks` (the cheap argument checks), `chat` (the REPL),
`bench_serve` (HTTP load).

Importing the package loads no jax: the engine is built only when a command runs."""

from __future__ import annotations

from tokenspeed_jax.cli.commands import main

__all__ = ["main"]
