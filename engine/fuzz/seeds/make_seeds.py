#!/usr/bin/env python3
"""Writes the small seed GGUF files for the gguf_parse fuzz target (checked in).

Run from this directory: python3 make_seeds.py
"""
import struct

def s(x):
    b = x.encode()
    return struct.pack("<Q", len(b)) + b

def kv(key, t, payload):
    return s(key) + struct.pack("<I", t) + payload

def arr(t, items):
    return struct.pack("<IQ", t, len(items)) + b"".join(items)

def gguf(kvs, tensors, align=32):
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs)
    infos, data, off = b"", b"", 0
    for name, dims, ty, payload in tensors:
        infos += s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", ty, off)
        pad = (-len(payload)) % align
        data += payload + b"\0" * pad
        off += len(payload) + pad
    out = head + infos
    if tensors:
        out += b"\0" * ((-len(out)) % align) + data
    return out

every_type = [
    kv("general.architecture", 8, s("llama")),
    kv("u8", 0, struct.pack("<B", 7)), kv("i8", 1, struct.pack("<b", -7)),
    kv("u16", 2, struct.pack("<H", 7)), kv("i16", 3, struct.pack("<h", -7)),
    kv("u32", 4, struct.pack("<I", 7)), kv("i32", 5, struct.pack("<i", -7)),
    kv("f32", 6, struct.pack("<f", 0.5)), kv("bool", 7, b"\x01"),
    kv("u64", 10, struct.pack("<Q", 7)), kv("i64", 11, struct.pack("<q", -7)),
    kv("f64", 12, struct.pack("<d", 0.5)),
    kv("strs", 9, arr(8, [s("a"), s("bc")])),
    kv("nested", 9, arr(9, [arr(5, [struct.pack("<i", 1)])])),
]
tensors = [
    ("f32", [4, 2], 0, struct.pack("<8f", *range(8))),
    ("f16", [2], 1, b"\x00\x3c\x00\x40"),
    ("q4_1", [32], 3, bytes(range(20))),
    ("q8_0", [32], 8, bytes(range(34))),
]

alphabet = [chr(c) for c in range(0x21, 0x7F)]
vocab = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġ"] + alphabet + ["he", "ll", "hell"]
tok_kvs = [
    kv("tokenizer.ggml.model", 8, s("gpt2")),
    kv("tokenizer.ggml.pre", 8, s("smollm")),
    kv("tokenizer.ggml.tokens", 9, arr(8, [s(t) for t in vocab])),
    kv("tokenizer.ggml.token_type", 9, arr(5, [struct.pack("<i", 3 if i < 3 else 1) for i in range(len(vocab))])),
    kv("tokenizer.ggml.merges", 9, arr(8, [s("h e"), s("l l"), s("he ll")])),
    kv("tokenizer.ggml.bos_token_id", 4, struct.pack("<I", 1)),
    kv("tokenizer.ggml.eos_token_id", 4, struct.pack("<I", 2)),
    kv("tokenizer.chat_template", 8, s("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")),
]

seeds = {
    "empty.gguf": gguf([], []),
    "every_type.gguf": gguf(every_type, tensors),
    "aligned64.gguf": gguf([kv("general.alignment", 4, struct.pack("<I", 64))], tensors[:2], align=64),
    "tokenizer.gguf": gguf(tok_kvs, []),
}
for name, blob in seeds.items():
    with open(f"gguf_parse/{name}", "wb") as f:
        f.write(blob)
    print(name, len(blob))
