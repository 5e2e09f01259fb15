"""`python -m tokenspeed_jax.cli ...` = the `tokenspeed-jax` console script."""

from __future__ import annotations

import sys

from tokenspeed_jax.cli.commands import main

sys.exit(main())
