"""transformers as an oracle on the same GGUF file we serve (parity tests, benchmarks/e2e.py).

`transformers_from_gguf("smollm2-135m" | "path/x.gguf") -> (torch model, transformers tokenizer)`
loads the file with `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`, every weight
dequantized to a dense float tensor (needs torch, transformers, gguf and accelerate: the `hf`
and `gguf` extras). Nothing is downloaded.
"""

from __future__ import annotations

from tokenspeed_jax.models.registry import gguf_location


def transformers_from_gguf(model: str, *, dtype: str = "float32"):
    """(transformers model in eval mode, its tokenizer) for a GGUF file or alias.

    dtype: "float32" | "bfloat16" | "float16" (the torch dtype the weights are dequantized to).
    """
    try:
        import torch
        import transformers
    except ImportError as e:
        raise ValueError(f"the transformers oracle needs torch + transformers (the hf extra): {e}") from e
    folder, name = gguf_location(model)
    kwargs = {}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:  # transformers >= 5 can keep blocks packed; we want dense weights
        kwargs["quantization_config"] = gguf_config(gguf_file=name, dequantize=True)
    torch_dtype = getattr(torch, dtype)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    net = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch_dtype, **kwargs
    )
    return net.eval(), tok
