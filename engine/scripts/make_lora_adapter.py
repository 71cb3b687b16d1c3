"""Writes the engine's test LoRA adapter: a deterministic random rank-r adapter for
SmolLM2-135M-Instruct in llama.cpp's adapter GGUF format. Run it through
`engine/scripts/make-lora-adapter`, which provides the pinned `gguf` and `numpy`.

Format (what llama.cpp's src/llama-adapter.cpp reads and checks, llama-cpp-python 0.3.36):
- KV: `general.type = "adapter"`, `general.architecture = "llama"` (must equal the base
  model's), `adapter.type = "lora"`, `adapter.lora.alpha` (f32).
- Tensors `blk.N.<w>.weight.lora_a` / `.lora_b` for every base weight `blk.N.<w>.weight`
  adapted. With the base weight W of ggml shape [n_in, n_out] (y = W x), lora_a has ggml
  shape [n_in, r] and lora_b [r, n_out]; llama.cpp computes
  y = W x + (alpha / r) * scale * (B (A x)), where `scale` is the one given to
  `--lora` / `--lora-scaled` (1.0 for `--lora`) and r is read from lora_b's ne[0].
  In numpy's (row-major) order, as stored here: A is (r, n_in) and B is (n_out, r),
  as PEFT's lora_A.weight and lora_B.weight.

Values: A ~ N(0, 1/n_in) and B ~ N(0, sigma_b^2), drawn in a fixed order (layer by
layer, the weights in ADAPTED order, A then B) from numpy's default_rng(seed), as
float64 and rounded to f32. sigma_b is chosen so that the update (alpha / r) * B A has
entries of RMS `--delta-rms` for every weight (the base Q4_1 weights' entries have an
RMS of about 0.19). Nothing depends on the base model's values, only on its shapes,
so the bytes depend only on the arguments and the pinned numpy/gguf versions.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
from pathlib import Path

import gguf
import numpy as np

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ADAPTER_FILE = "smollm2-lora-test.gguf"
# The base weights the adapter touches (llama.cpp's names), in generation order.
ADAPTED = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# What SmolLM2-135M-Instruct has; checked against the file, so another base model is
# refused instead of getting an adapter that llama.cpp would reject.
EXPECTED = {
    "block_count": 30,
    "embedding_length": 576,
    "feed_forward_length": 1536,
    "head_count": 9,
    "head_count_kv": 3,
}


def cache_dir() -> Path:
    return Path(os.environ.get("SLIPWAY_CACHE") or Path.home() / ".cache/slipway")


def base_shapes(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """The base model's layer count and the (n_in, n_out) of each adapted weight,
    checked to be the same in every layer and to be SmolLM2-135M's."""
    reader = gguf.GGUFReader(path)

    def field(key: str):
        f = reader.get_field(key)
        if f is None:
            sys.exit(f"{path}: no {key}")
        return f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        sys.exit(f"{path}: architecture {arch!r}, expected 'llama'")
    hp = {k: int(field(f"llama.{k}" if "head" not in k else f"llama.attention.{k}")) for k in EXPECTED}
    if hp != EXPECTED:
        sys.exit(f"{path}: hyperparameters {hp}, expected SmolLM2-135M's {EXPECTED}")
    n_layers = hp["block_count"]
    head_dim = hp["embedding_length"] // hp["head_count"]
    kv = hp["head_count_kv"] * head_dim
    d, ff = hp["embedding_length"], hp["feed_forward_length"]
    want = {
        "attn_q": (d, d), "attn_k": (d, kv), "attn_v": (d, kv), "attn_output": (d, d),
        "ffn_gate": (d, ff), "ffn_up": (d, ff), "ffn_down": (ff, d),
    }
    tensors = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
    for layer in range(n_layers):
        for w in ADAPTED:
            name = f"blk.{layer}.{w}.weight"
            if tensors.get(name) != want[w]:
                sys.exit(f"{path}: {name} has ggml shape {tensors.get(name)}, expected {want[w]}")
    return n_layers, want


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, default=cache_dir() / "models" / MODEL_FILE,
                    help="the base model GGUF (read for its shapes only)")
    ap.add_argument("--out", type=Path, default=cache_dir() / "models" / ADAPTER_FILE)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--delta-rms", type=float, default=0.01,
                    help="RMS of the entries of (alpha / r) * B A, per adapted weight")
    args = ap.parse_args()

    n_layers, shapes = base_shapes(args.base)
    r, alpha = args.rank, args.alpha
    s = alpha / r
    rng = np.random.default_rng(args.seed)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, arch="llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_name("smollm2-lora-test")
    writer.add_description(
        f"Slipway test LoRA for SmolLM2-135M-Instruct: random, rank {r}, alpha {alpha:g}, "
        f"seed {args.seed}, delta RMS {args.delta_rms:g} (engine/scripts/make-lora-adapter)"
    )
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    # How it was made, for record-lora-oracle's fixture (llama.cpp ignores these keys).
    writer.add_uint32("slipway.lora.seed", args.seed)
    writer.add_float32("slipway.lora.delta_rms", args.delta_rms)

    for layer in range(n_layers):
        for w in ADAPTED:
            n_in, n_out = shapes[w]
            sigma_a = 1.0 / math.sqrt(n_in)
            # entries of s * B A: RMS = s * sqrt(r) * sigma_a * sigma_b
            sigma_b = args.delta_rms / (s * math.sqrt(r) * sigma_a)
            a = (rng.standard_normal((r, n_in)) * sigma_a).astype(np.float32)
            b = (rng.standard_normal((n_out, r)) * sigma_b).astype(np.float32)
            writer.add_tensor(f"blk.{layer}.{w}.weight.lora_a", a)
            writer.add_tensor(f"blk.{layer}.{w}.weight.lora_b", b)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, args.out)

    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()
    print(
        f"make-lora-adapter: {n_layers} layers x {len(ADAPTED)} weights, rank {r}, alpha {alpha:g} "
        f"(scale {s:g}), seed {args.seed}, delta RMS {args.delta_rms:g}; sha256 {digest}",
        file=sys.stderr,
    )
    print(args.out)


if __name__ == "__main__":
    main()
