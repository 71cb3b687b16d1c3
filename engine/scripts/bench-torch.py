#!/usr/bin/env python3
"""PyTorch `transformers` peer for bench-gpu: the same model, from our GGUF.

Reads the GGUF (a minimal reader: header, metadata, tensor table), dequantizes every
tensor (Q4_1, Q8_0, F16, F32) to fp16, un-permutes Q/K (GGUF llama files permute them
for ggml's adjacent-pair RoPE; transformers rotates halves), builds
LlamaForCausalLM from the metadata and measures on the given device, like
tests/cuda_bench.rs:
  - single-stream decode tokens/s: generate() at batch 1;
  - aggregate decode tokens/s: generate() at each batch size;
  - prefill tokens/s: one forward over a PREFILL-token prompt.
generate() runs greedy with min_new_tokens = max_new_tokens = STEPS (no early stop);
its time includes the 16-token prefill, which at STEPS=128 is a small share.
Prints one line `BENCH {...}`. Nothing is downloaded.

Usage: bench-torch.py MODEL.gguf [--device cuda] [--batches 16,64,256] [--steps 128]
       [--prefill 512] [--check]   (--check: only parse and dequantize, print shapes)
"""
import argparse
import json
import struct
import sys
import time

import numpy as np

GGML_F32, GGML_F16, GGML_Q4_1, GGML_Q8_0 = 0, 1, 3, 8
BLOCK = {GGML_F32: (1, 4), GGML_F16: (1, 2), GGML_Q4_1: (32, 20), GGML_Q8_0: (32, 34)}


class Reader:
    def __init__(self, buf):
        self.b, self.o = buf, 0

    def take(self, fmt):
        v = struct.unpack_from("<" + fmt, self.b, self.o)
        self.o += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def string(self):
        n = self.take("Q")
        s = bytes(self.b[self.o:self.o + n]).decode("utf-8", errors="replace")
        self.o += n
        return s

    SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(self, t):
        if t in self.SCALAR:
            return self.take(self.SCALAR[t])
        if t == 8:
            return self.string()
        if t == 9:
            et, n = self.take("I"), self.take("Q")
            if et in self.SCALAR:
                size = struct.calcsize(self.SCALAR[et])
                self.o += size * n  # arrays (the vocabulary) are not needed here
                return None
            return [self.value(et) for _ in range(n)] if et != 8 else [self.string() for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {t}")


def read_gguf(path):
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    r = Reader(memoryview(buf))
    if bytes(buf[:4]) != b"GGUF":
        sys.exit(f"{path}: not a GGUF file")
    r.o = 4
    version, n_tensors, n_kv = r.take("I"), r.take("Q"), r.take("Q")
    meta = {}
    for _ in range(n_kv):
        k = r.string()
        meta[k] = r.value(r.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        nd = r.take("I")
        dims = [r.take("Q") for _ in range(nd)]
        t, off = r.take("I"), r.take("Q")
        infos.append((name, dims, t, off))
    align = meta.get("general.alignment", 32)
    base = (r.o + align - 1) // align * align
    return buf, meta, infos, base, version


def dequant(buf, base, dims, t, off):
    n = int(np.prod(dims))
    per, size = BLOCK[t]
    raw = buf[base + off: base + off + n // per * size]
    if t == GGML_F32:
        out = raw.view(np.float32).astype(np.float32)
    elif t == GGML_F16:
        out = raw.view(np.float16).astype(np.float32)
    elif t == GGML_Q8_0:
        b = raw.reshape(-1, 34)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        q = b[:, 2:].view(np.int8).astype(np.float32)
        out = (q * d).reshape(-1)
    elif t == GGML_Q4_1:
        b = raw.reshape(-1, 20)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = b[:, 4:]
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)
        out = (q * d + m).reshape(-1)
    else:
        sys.exit(f"tensor type {t} not handled")
    # GGUF dims are (cols, rows): row-major [rows][cols], as torch Linear weights.
    return out.reshape(list(reversed(dims)))


def unpermute(w, n_head):
    # Inverse of llama.cpp's convert permute(): (n_head, 2, hd/2, in) <- (n_head, hd/2, 2, in).
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def state_dict(buf, meta, infos, base):
    nh = meta["llama.attention.head_count"]
    nkv = meta.get("llama.attention.head_count_kv", nh)
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    per_layer = {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    sd = {}
    for name, dims, t, off in infos:
        w = dequant(buf, base, dims, t, off)
        if name in names:
            key = names[name]
        else:
            _, i, part, _ = name.split(".")
            key = f"model.layers.{i}.{per_layer[part]}.weight"
            if part == "attn_q":
                w = unpermute(w, nh)
            elif part == "attn_k":
                w = unpermute(w, nkv)
        sd[key] = w
    return sd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    buf, meta, infos, base, version = read_gguf(a.model)
    sd = state_dict(buf, meta, infos, base)
    if a.check:
        print(f"GGUF v{version}: {len(infos)} tensors, {sum(v.size for v in sd.values())} parameters")
        for k in ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"]:
            v = sd[k]
            print(f"  {k}: {v.shape} mean|w| {np.abs(v).mean():.5f}")
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dim = meta["llama.embedding_length"]
    nh = meta["llama.attention.head_count"]
    vocab = sd["model.embed_tokens.weight"].shape[0]
    tied = "lm_head.weight" not in sd
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"], num_attention_heads=nh,
        num_key_value_heads=meta.get("llama.attention.head_count_kv", nh),
        rms_norm_eps=meta["llama.attention.layer_norm_rms_epsilon"],
        rope_theta=meta.get("llama.rope.freq_base", 10000.0),
        max_position_embeddings=meta["llama.context_length"], tie_word_embeddings=tied,
        torch_dtype=torch.float16,
    )
    model = LlamaForCausalLM(cfg).to(torch.float16)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}, strict=False)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        sys.exit(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    if tied:
        model.tie_weights()
    model = model.to(a.device).eval()
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)

    def gen_rate(b):
        ids = torch.randint(100, vocab - 100, (b, a.prompt), device=a.device)
        kw = dict(max_new_tokens=a.steps, min_new_tokens=a.steps, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            model.generate(ids, **dict(kw, max_new_tokens=4, min_new_tokens=4))  # warm-up
            sync()
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            sync()
        return b * a.steps / (time.perf_counter() - t0)

    single = gen_rate(1)
    agg = {b: gen_rate(int(b)) for b in a.batches.split(",")}
    ids = torch.randint(100, vocab - 100, (1, a.prefill), device=a.device)
    with torch.no_grad():
        model(ids)
        sync()
        t0 = time.perf_counter()
        for _ in range(3):
            model(ids)
        sync()
    pf = 3 * a.prefill / (time.perf_counter() - t0)
    print("BENCH " + json.dumps({
        "engine": f"transformers-{torch.__version__}-fp16-{a.device}",
        "decode_single_tok_s": round(single, 1),
        "decode_aggregate_tok_s": {str(b): round(v, 1) for b, v in agg.items()},
        "prefill_tok_s": round(pf, 1), "prompt": a.prompt, "steps": a.steps, "prefill_len": a.prefill,
    }))


main()
