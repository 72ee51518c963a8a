"""What a predictor's prefill costs on a GPU, for the predictive codec's break-even (docs/predictive.md).

    python bench/predictor_prefill.py [--tokens 1024,4096] [--models smollm2-135m,llama-3-8b] [--json out.json]

The predictive codec needs the predictor's KV of the same prompt on both sides, so each side
runs a predictor prefill per request. This times that prefill (median CUDA-event seconds of a
batch-1 forward with ``use_cache=True``) for Llama-architecture models built from their configs
with random weights: the time of a dense forward does not depend on the weights' values. BF16
weights and activations (an FP8 W8A8 predictor would run on the FP8 tensor cores; its time is
estimated from this one, labelled so). Each row also gives the model's KV bytes and the link
speed below which the predictive codec saves more link time than two predictor prefills cost,
for the ratios measured on SmolLM2 (docs/predictive.md) against ``entropy``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

MODELS = {  # Llama-architecture shapes (public configs)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256),
}
RATIOS = {"predictive (fp8 predictor)": 2.496, "entropy": 1.529}  # BF16 KV, docs/predictive.md


def prefill_seconds(name: str, tokens: int, repeats: int) -> tuple[float, int]:
    """(median seconds of one prefill of ``tokens`` tokens, KV bytes per token in bf16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODELS[name], max_position_embeddings=max(8192, tokens), torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, tokens), device="cuda")
    times = []
    with torch.no_grad():
        for i in range(repeats + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(ids, use_cache=True)
            end.record()
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end) / 1e3)
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size
                                                                                // config.num_attention_heads) * 2
    del model
    torch.cuda.empty_cache()
    return statistics.median(times), kv_per_token


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,4096")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    rows = []
    print(f"{device}, torch {torch.__version__}; BF16 prefill, batch 1; break-even: predictive saves more link "
          f"time than the two prefills (sender and receiver) cost, vs entropy")
    print("| model | tokens | prefill ms (bf16) | KV MiB | break-even link GB/s (bf16 predictor) | (fp8 est., ½ time) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            seconds, per_token = prefill_seconds(name, tokens, args.repeats)
            kv = per_token * tokens
            # link time saved per byte of KV: (1/r_entropy - 1/r_predictive) / link; pays if that
            # exceeds 2 * prefill (both sides): link < kv * saving / (2 * prefill)
            saving = 1 / RATIOS["entropy"] - 1 / RATIOS["predictive (fp8 predictor)"]
            even = kv * saving / (2 * seconds) / 1e9
            rows.append({"model": name, "tokens": tokens, "prefill_s": seconds, "kv_bytes": kv,
                         "break_even_gbps_bf16": even, "break_even_gbps_fp8_estimate": 2 * even})
            print(f"| {name} | {tokens} | {seconds * 1e3:.2f} | {kv / 2**20:.1f} | {even:.2f} | {2 * even:.2f} |",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": device, "torch": torch.__version__, "command": " ".join(sys.argv),
                                         "ratios": RATIOS, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
