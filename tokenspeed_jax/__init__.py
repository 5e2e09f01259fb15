"""tokenspeed-jax runtime: page tables, pools, models, runner, engine, server, CLI."""
