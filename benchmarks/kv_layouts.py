"""FP8 KV layouts taken apart: which part of a layout's rounding costs a trained model its accuracy.

    python benchmarks/kv_layouts.py [--model kimi-k2.6] [--rope yarn,no-mscale,no-yarn] [--variants NAME,...]
                                    [--context 256,1024] [--max-tokens 16384] [--prompts 16] [--json FILE]

nano's three FP8 page layouts (nano/kv.py) differ from one another in more than one way at once: `tile` keeps the
rope key in BF16 *and* scales the latent per tile where `token` rounds the rope key too and scales the whole
latent ‖ rope vector by one per-token scale. To tell the causes apart this study rounds the KV in ways that are
not production layouts. Each variant is a function from the float32 values a layer writes ([..., C + R], latent ‖
rope key) to the values attention will read: the model runs with float32 pages, and the pool's `encode` is
replaced on that one instance by "round as the variant does, then store in float32" (fake quantization). Nothing
in nano/ changes. The `token`, `tensor` and `tile` variants reproduce the production layouts' rounding (checked
against `nano eval --compare kv-dtype=fp8:...`, which folds the per-token scale into attention instead). The DSA
indexer keys of a GLM model stay in float32 in every variant (production FP8 pages round them too): the study is
about the latent ‖ rope key.

    token               one scale per token over latent ‖ rope (amax / 448)           = production `token`
    token/rope-exact    the same per-token scale (over latent ‖ rope); rope key left unrounded
    latent-token        one scale per token over the latent alone; rope key unrounded
    rope-token          only the rope key rounded, with a per-token scale of its own; latent unrounded
    tile                latent: power-of-two scale per C/4 values; rope key in BF16      = production `tile`
    tile/one-scale      as tile, but one power-of-two scale over the whole latent (a tile as wide as the latent)
    tile/rope-fp8       the tile latent, and the rope key rounded with a per-token scale of its own
    tensor              every value rounded to e4m3 as it is (scale fixed at 1)        = production `tensor`

`--rope` runs the model as its checkpoint has it (`yarn`, the default; for a model without YaRN, such as the GLM
stand-in, that is its plain RoPE), with YaRN's attention-temperature correction switched off
(`no-mscale`: softmax scale 1/sqrt(d) instead of mscale^2/sqrt(d), frequencies kept) or with YaRN switched off
altogether (`no-yarn`: plain RoPE at the same theta, no mscale). The last two change the model (its weights were
trained with YaRN), so each rope setting has its own float32 reference (float32 KV, the same rope setting) and
every KL is FP8's damage to *that* model. The variants are built as a copy of the checkpoint directory (weights and
tokenizer linked, config.json edited) in a temporary directory.

Before the evaluation the study prints, for the reference's first window at the longest context, each variant's
rounding error per component (relative RMS error of the latent and of the rope key, averaged over the layers) and
how often the rope key holds a token's largest value (then the per-token scale is set by the rope key).

Every figure is measured here, on this machine; it prints the command's time and the load average. The defaults
(Kimi, its checkpoint's YaRN, all eight variants, contexts 256 and 1,024) took 4 min 11 s on 2 CPU cores at load
1.5-2.3; docs/eval.md §8 shows the figures and what they say.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from nano import LLM
from nano.config import TILES
from nano.evaluate import HELDOUT_TEXT, Candidate, Settings, evaluate, read_text, tokenize
from nano.kv import quantize_fp8
from nano.loader import resolve_model
from nano.quant import FP8_MAX

Variant = Callable[[torch.Tensor, int], torch.Tensor]   # (values [..., C + R] fp32, C) -> rounded values


def per_token(values: torch.Tensor) -> torch.Tensor:
    codes, scale = quantize_fp8(values)
    return codes.float() * scale[..., None]


def per_tile(values: torch.Tensor, tile: int) -> torch.Tensor:
    codes, scale = quantize_fp8(values, tile)
    return (codes.float().unflatten(-1, (-1, tile)) * scale[..., None]).flatten(-2)


def token_rope_exact(values: torch.Tensor, rank: int) -> torch.Tensor:
    rounded = per_token(values)   # the scale is set over latent ‖ rope, as in the token layout
    return torch.cat([rounded[..., :rank], values[..., rank:]], -1)


VARIANTS: dict[str, Variant] = {
    "token": lambda v, c: per_token(v),
    "token/rope-exact": token_rope_exact,
    "latent-token": lambda v, c: torch.cat([per_token(v[..., :c]), v[..., c:]], -1),
    "rope-token": lambda v, c: torch.cat([v[..., :c], per_token(v[..., c:])], -1),
    "tile": lambda v, c: torch.cat([per_tile(v[..., :c], c // TILES), v[..., c:].bfloat16().float()], -1),
    "tile/one-scale": lambda v, c: torch.cat([per_tile(v[..., :c], c), v[..., c:].bfloat16().float()], -1),
    "tile/rope-fp8": lambda v, c: torch.cat([per_tile(v[..., :c], c // TILES), per_token(v[..., c:])], -1),
    "tensor": lambda v, c: v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float(),
}
ROPE_SETTINGS = ("yarn", "no-mscale", "no-yarn")


def rope_variant(model: str, setting: str, workdir: Path) -> str:
    """The checkpoint directory of `model` with its rope setting changed (`yarn`: the checkpoint as it is)."""
    source = resolve_model(model).path
    if source is None:
        raise SystemExit(f"{model} resolves to random weights: this study needs a trained checkpoint")
    if setting == "yarn":
        return str(source)
    raw = json.loads((source / "config.json").read_text())
    key = "rope_parameters" if "rope_parameters" in raw else "rope_scaling"
    rope = dict(raw.get(key) or {})
    if rope.get("rope_type", rope.get("type")) != "yarn":
        raise SystemExit(f"{model} has no YaRN scaling to switch off")
    if setting == "no-mscale":   # frequencies as trained; softmax scale and cos/sin amplitude both 1
        rope.update(mscale_all_dim=0, attention_factor=1.0)
    else:                        # plain RoPE at the same theta
        rope = {"rope_type": "default", "rope_theta": rope.get("rope_theta", raw.get("rope_theta", 10000.0))}
    raw[key] = rope
    target = workdir / setting
    target.mkdir()
    for item in source.iterdir():
        if item.name != "config.json":
            (target / item.name).symlink_to(item.resolve())
    (target / "config.json").write_text(json.dumps(raw, indent=2))
    return str(target)


def build(path: str, variant: str | None) -> LLM:
    """The model with float32 pages; with a variant, its pool rounds every latent ‖ rope key it stores."""
    llm = LLM(path, kv_dtype="fp32", progress=False)
    if variant is not None:
        pool, rank, store = llm.pool, llm.config.kv_lora_rank, llm.pool.encode
        fake = VARIANTS[variant]
        pool.encode = lambda values, index=False: store(values if index else fake(values.float(), rank), index)
    return llm


def rounding_errors(path: str, ids: list[int], variants: list[str]) -> dict[str, dict[str, float]]:
    """Per variant: relative RMS rounding error of the latent and of the rope key over the values the reference
    writes while scoring `ids` (mean over layers), and the share of tokens whose largest |value| is in the rope key."""
    llm = build(path, None)
    written: list[torch.Tensor] = []
    write = llm.pool.write
    rank = llm.config.kv_lora_rank

    def capture(layer: int, slots: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor) -> None:
        written.append(torch.cat([latent, rope_key], -1).float().cpu())
        write(layer, slots, latent, rope_key)

    llm.pool.write = capture
    llm.score(ids)
    llm.close()
    layers = llm.config.num_hidden_layers
    per_layer = [torch.cat(written[layer::layers]) for layer in range(layers)]   # chunks come layer after layer
    out: dict[str, dict[str, float]] = {}

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    for name in variants:
        rounded = [VARIANTS[name](v, rank) for v in per_layer]
        latent = [rel(r[:, :rank], v[:, :rank]) for r, v in zip(rounded, per_layer)]
        rope = [rel(r[:, rank:], v[:, rank:]) for r, v in zip(rounded, per_layer)]
        out[name] = {"latent_rel_rms": sum(latent) / layers, "rope_rel_rms": sum(rope) / layers}
    rope_max = [float((v[:, rank:].abs().amax(-1) > v[:, :rank].abs().amax(-1)).double().mean()) for v in per_layer]
    out["rope_holds_token_max"] = {"share": sum(rope_max) / layers, "per_layer": rope_max}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="kimi-k2.6")
    parser.add_argument("--rope", default="yarn", help=f"comma-separated: {', '.join(ROPE_SETTINGS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--context", default="256,1024")
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    settings_list = args.rope.split(",")
    variants = args.variants.split(",")
    bad = [s for s in settings_list if s not in ROPE_SETTINGS] + [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown rope setting or variant: {bad[0]}")
    settings = Settings(contexts=tuple(int(c) for c in args.context.split(",")), max_tokens=args.max_tokens,
                        prompts=args.prompts)
    text = read_text(HELDOUT_TEXT)
    results: dict[str, dict] = {}
    start, load = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for setting in settings_list:
            path = rope_variant(args.model, setting, Path(tmp))
            probe = build(path, None)
            ids = tokenize(text, probe.tokenizer, max(settings.contexts))[0][:max(settings.contexts)]
            probe.close()
            errors = rounding_errors(path, ids, variants)
            print(f"\n== {args.model}, rope {setting}: rounding error per component (first {len(ids):,} tokens, "
                  f"mean over layers); the rope key holds the token's largest |value| in "
                  f"{errors['rope_holds_token_max']['share']:.1%} of tokens")
            for name in variants:
                err = errors[name]
                print(f"  {name:18s} latent {err['latent_rel_rms']:.2e}  rope {err['rope_rel_rms']:.2e}")
            reference = Candidate("reference", lambda p=path: build(p, None), key="ref")
            candidates = [Candidate(name, lambda p=path, n=name: build(p, n)) for name in variants]
            report = evaluate(text, reference, candidates, settings)
            rows = {}
            print("  reference bits/byte: " + ", ".join(f"{c.context}: {c.bits_per_byte.value:.4f}"
                                                       for c in report.reference.contexts))
            print(f"  {'variant':18s} {'context':>7s} {'KL mean':>9s} {'Δ bits/byte [95%]':>28s} {'top-1 agr':>9s}"
                  f"  greedy median; identical")
            for conf in report.configurations:
                gen = conf.generation
                rows[conf.name] = {"contexts": {}, "greedy_median": gen.median.value, "identical": gen.identical}
                for c in conf.contexts:
                    d = c.delta_bits_per_byte
                    rows[conf.name]["contexts"][c.context] = {
                        "kl_mean": c.kl_mean.value, "kl_p99": c.kl_p99.value, "top1_agreement": c.top1_agreement.value,
                        "delta_bits_per_byte": [d.value, d.low, d.high, d.verdict]}
                    print(f"  {conf.name:18s} {c.context:7d} {c.kl_mean.value:9.2e} "
                          f"{d.value:+.4f} [{d.low:+.4f}, {d.high:+.4f}] {d.verdict:>12s} "
                          f"{c.top1_agreement.value:9.2%}  {gen.median.value:g}; {gen.identical}")
            results[setting] = {"reference_bits_per_byte": {c.context: c.bits_per_byte.value
                                                            for c in report.reference.contexts},
                                "rounding": errors, "variants": rows}
    seconds = time.perf_counter() - start
    print(f"\n{seconds:.0f} s; load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end "
          f"({os.cpu_count()} CPUs)")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "settings": vars(args), "seconds": seconds,
                                               "results": results}, indent=2))


if __name__ == "__main__":
    main()
