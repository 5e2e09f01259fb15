"""benchmarks/device_check.sh is run once, unattended, in a rare 15-minute GPU window: check on
CPU that it parses, that its embedded Python parses, and that its step timeouts fit the window."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "device_check.sh"


def test_bash_syntax() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_embedded_python_parses() -> None:
    text = SCRIPT.read_text()
    blocks = re.findall(r"<<'PY'.*?\n(.*?)\nPY\n", text, flags=re.S)
    assert len(blocks) >= 3
    for block in blocks:
        ast.parse(block)


def test_timeouts_fit_the_window() -> None:
    """Every step runs under `timeout`; together at most 540 s of a 15-minute window."""
    text = SCRIPT.read_text()
    timeouts = [int(n) for n in re.findall(r"^\s*timeout (\d+) ", text, flags=re.M)]
    commands = re.findall(r"^\s*(?:timeout \d+ )?python3? ", text, flags=re.M)
    assert len(timeouts) == len(commands) >= 5, (timeouts, commands)
    assert sum(timeouts) <= 540, timeouts
