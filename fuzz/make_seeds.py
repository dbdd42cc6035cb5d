#!/usr/bin/env python3
"""Writes the binary seeds of fuzz/corpus/ (safetensors files, token shards, encoded tensors), which are
committed; run it again only to change them. The text seeds are written by hand. The checkpoint manifest seed
comes from the fuzz target itself (GEOTRAIN_FUZZ_DUMP_MANIFEST, see checkpoint_manifest_fuzzer.cc)."""
import json
import os
import struct

here = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    os.makedirs(os.path.join(here, "corpus", target), exist_ok=True)
    with open(os.path.join(here, "corpus", target, name), "wb") as f:
        f.write(data)


def safetensors(tensors, metadata=None):
    header, blob = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob


write("safetensors", "f32", safetensors([("wte.weight", "F32", [2, 3], struct.pack("<6f", *range(6))),
                                         ("ln_f.bias", "F32", [3], struct.pack("<3f", 1, -1, 0.5))],
                                        {"format": "pt", "step": "7"}))
write("safetensors", "half", safetensors([("a", "F16", [4], struct.pack("<4H", 0x3C00, 0x8001, 0x7C00, 0x7E00)),
                                          ("b", "BF16", [2, 1], struct.pack("<2H", 0x3F80, 0xFF80))]))
write("safetensors", "empty_and_scalar", safetensors([("e", "F32", [0, 5], b""), ("s", "F32", [], b"\0\0\x80\x3f")]))

def shard(tokens, magic=20240520, version=1, count=None):
    header = [0] * 256
    header[0], header[1], header[2] = magic, version, len(tokens) if count is None else count
    return struct.pack("<256i", *header) + struct.pack("<%dH" % len(tokens), *tokens)


write("token_shard", "small", shard([50256, 15496, 995, 0, 50256]))
write("token_shard", "empty", shard([]))
write("token_shard", "bad_count", shard([1, 2, 3], count=4))

# Encoded tensors (comm/codec.h): control byte 7 asks the fuzzer to repair the payload size and both CRCs.
MAGIC = 0x43445447


def encoded(kind, flags, count, raw, payload):
    return bytes([7]) + struct.pack("<IBBBBQQQII", MAGIC, 1, kind, flags, 0, count, len(payload), raw, 0, 0) + payload


floats = struct.pack("<4f", 1.0, -2.5, 0.0, 3e38)
write("codec", "none", encoded(0, 0, 4, 16, floats))
write("codec", "fp16", encoded(1, 0, 4, 8, struct.pack("<4H", 0x3C00, 0xC100, 0, 0x7BFF)))
write("codec", "bf16", encoded(2, 0, 4, 8, struct.pack("<4H", 0x3F80, 0xC020, 0, 0x7F7F)))
write("codec", "int8", encoded(3, 0, 3, 4 + 3, struct.pack("<f3b", 0.5, 127, -127, 3)))
write("codec", "topk", encoded(4, 0, 10, 8 + 16, struct.pack("<Q2I2f", 2, 1, 7, 0.25, -4.0)))
# zstd of the 16 "none" bytes above would need zstd here; the fuzzer finds frames from this stored frame
# (magic, frame header with content size 16, one raw block).
frame = struct.pack("<I", 0xFD2FB528) + bytes([0x20, 16]) + struct.pack("<I", (16 << 3) | 1)[:3] + floats
write("codec", "none_zstd", encoded(0, 1, 4, 16, frame))
write("codec", "roundtrip_bf16", bytes([8]) + b"bf16\0" + floats)
write("codec", "roundtrip_int8_zstd", bytes([8]) + b"int8+zstd:3\0" + floats * 70)
write("codec", "roundtrip_topk", bytes([8]) + b"topk:0.5\0" + floats)
write("codec", "roundtrip_none", bytes([8]) + b"none+zstd\0" + floats)
