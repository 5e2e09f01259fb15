"""Session fixture: the nine tiny checkpoints, built once into a temp dir (needs torch)."""

from __future__ import annotations

import pytest

FAMILIES = ("llama", "qwen3", "mistral", "lfm2", "gpt_oss", "gemma2", "gemma3", "qwen3_5", "bamba")
# Page pools of the engine tests (page size 4, 4 requests of ~50 tokens at once): tight enough that
# the scheduler must retract. Sliding-only Mistral reclaims slid-out pages, hence a smaller pool.
NUM_PAGES = {
    "llama": 22, "qwen3": 30, "mistral": 14, "lfm2": 24, "gpt_oss": 30, "gemma2": 30, "gemma3": 30,
    "qwen3_5": 30, "bamba": 30,
}  # fmt: skip


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
