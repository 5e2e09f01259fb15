"""Session fixture: the seven tiny checkpoints, built once into a temp dir (needs torch)."""

from __future__ import annotations

import pytest

FAMILIES = ("llama", "qwen3", "mistral", "lfm2", "gpt_oss", "gemma2", "gemma3")


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """name -> (checkpoint dir, the transformers model that wrote it). qwen3 is sharded."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.hf.checkpoints import build_checkpoint, family_configs

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, config in family_configs().items():
        path = str(root / name)
        shard = "200KB" if name == "qwen3" else None
        out[name] = (path, build_checkpoint(name, config, path, max_shard_size=shard))
    return out
