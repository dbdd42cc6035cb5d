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
# int4: a scale per 64 elements, then 4-bit codes -7..7, element 2j in the low nibble of byte j (3 elements: 3.5,
# -3.5, 1.5 and a zero padding nibble).
write("codec", "int4", encoded(5, 0, 3, 4 + 2, struct.pack("<f2B", 0.5, 0x97, 0x03)))


def bits(fields, width):
    """Packs `fields` as one little-endian bit stream of `width` bits each (bit b at bit b % 8 of byte b / 8)."""
    value = sum(f << (i * width) for i, f in enumerate(fields))
    return value.to_bytes((len(fields) * width + 7) // 8, "little")


def sparse(kept_full, kept_last, b, scales, offsets, codes):
    """A sparse payload: the preamble, a scale per 4096 elements, 12-bit offsets, then B-bit codes."""
    return (struct.pack("<IIB3x", kept_full, kept_last, b) + struct.pack("<%df" % len(scales), *scales) +
            bits(offsets, 12) + bits(codes, b))


# sparse: 10 elements (one block), the 2 kept at offsets 1 and 7 with 2-bit codes 3 and 0 of scale 0.75 (values
# (2c + 1 - 4) / 4 x 0.75: 0.5625 and -0.5625); kept per full block 82 = ceil(0.02 x 4096), unused with one block.
payload = sparse(82, 2, 2, [0.75], [1, 7], [3, 0])
write("codec", "sparse", encoded(6, 0, 10, len(payload), payload))
# Two blocks (4096 + 4 elements), 3 kept in the full one and 1 in the last, 5-bit codes.
payload = sparse(3, 1, 5, [2.0, 0.5], [0, 100, 4095, 3], [31, 0, 17, 9])
write("codec", "sparse_two_blocks", encoded(6, 0, 4100, len(payload), payload))
# zstd of the 16 "none" bytes above would need zstd here; the fuzzer finds frames from this stored frame
# (magic, frame header with content size 16, one raw block).
frame = struct.pack("<I", 0xFD2FB528) + bytes([0x20, 16]) + struct.pack("<I", (16 << 3) | 1)[:3] + floats
write("codec", "none_zstd", encoded(0, 1, 4, 16, frame))
write("codec", "roundtrip_bf16", bytes([8]) + b"bf16\0" + floats)
write("codec", "roundtrip_int8_zstd", bytes([8]) + b"int8+zstd:3\0" + floats * 70)
write("codec", "roundtrip_topk", bytes([8]) + b"topk:0.5\0" + floats)
write("codec", "roundtrip_none", bytes([8]) + b"none+zstd\0" + floats)
write("codec", "roundtrip_int4", bytes([8]) + b"int4\0" + floats * 20)
write("codec", "roundtrip_int4_zstd", bytes([8]) + b"int4+zstd\0" + floats * 17)
write("codec", "roundtrip_sparse", bytes([8]) + b"sparse:0.5:3\0" + floats * 70)
write("codec", "roundtrip_sparse_blocks", bytes([8]) + b"sparse+zstd\0" + floats * 1100)  # 4400 values: two blocks


# Tensor streams (fuzz/tensor_chunks_fuzzer.cc): a control byte (bit 0: a receiver is waiting, so element-wise
# codecs are decoded on arrival), then messages, each a 2-byte little-endian length and a serialized TensorChunk.
def crc32c(data, crc=0):
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def varint(v):
    out = b""
    while v >= 0x80:
        out += bytes([(v & 0x7F) | 0x80])
        v >>= 7
    return out + bytes([v])


def field(number, wire, value):
    tag = varint(number << 3 | wire)
    if wire == 0:
        return tag + varint(value)
    if wire == 1:
        return tag + struct.pack("<Q", value)
    return tag + varint(len(value)) + value


def codec_bytes(kind, values):
    if kind == 0:
        payload = struct.pack("<%df" % len(values), *values)
    else:  # bf16: the high half of each float (the values below are exact in bf16)
        payload = b"".join(struct.pack("<f", v)[2:] for v in values)
    head = struct.pack("<IBBBBQQQI", MAGIC, 1, kind, 0, 0, len(values), len(payload), len(payload), crc32c(payload))
    return head + struct.pack("<I", crc32c(head)) + payload


def tensor_chunks(tensor_id, codec, kind, values, chunk_bytes, trailer=False):
    encoded = codec_bytes(kind, values)
    checksum = 0 if trailer else struct.unpack("<I", encoded[32:36])[0]
    sent = encoded[:32] + b"\0" * 8 + encoded[40:] if trailer else encoded
    key = field(1, 2, b"job-1") + field(2, 0, 3) + field(3, 0, 1) + field(4, 2, tensor_id) + field(5, 2, b"rank0")
    header = (field(1, 2, key) + field(2, 0, 1) + field(3, 2, varint(len(values))) + field(4, 2, codec) +
              field(5, 0, len(encoded)) + field(6, 0, checksum) + field(7, 0, chunk_bytes))
    out = b""
    for offset in range(0, len(encoded), chunk_bytes):
        last = offset + chunk_bytes >= len(encoded)
        chunk = field(1, 2, header) if offset == 0 else b""
        chunk += field(2, 0, offset) + field(3, 0, int(last))
        if last and trailer:
            chunk += field(5, 1, struct.unpack("<Q", encoded[32:40])[0])
        chunk += field(4, 2, sent[offset:offset + chunk_bytes])
        out += struct.pack("<H", len(chunk)) + chunk
    return out


values = [1.0, -2.5, 0.0, 3.0, 0.5, -0.25, 8.0]
write("tensor_chunks", "mailbox_none_one_chunk", bytes([0]) + tensor_chunks(b"act/0", b"none", 0, values, 1024))
write("tensor_chunks", "mailbox_none_two_tensors",
      bytes([0]) + tensor_chunks(b"a", b"none", 0, values, 24) + tensor_chunks(b"b", b"none", 0, values[:3], 1024))
write("tensor_chunks", "arrival_none_chunks", bytes([1]) + tensor_chunks(b"act/0", b"none", 0, values, 18))
write("tensor_chunks", "arrival_bf16_odd_chunks", bytes([1]) + tensor_chunks(b"g", b"bf16", 2, values, 13))
write("tensor_chunks", "arrival_bf16_trailer", bytes([1]) + tensor_chunks(b"g", b"bf16", 2, values, 16, True))
write("tensor_chunks", "mailbox_bf16_trailer", bytes([0]) + tensor_chunks(b"g", b"bf16", 2, values, 16, True))
write("tensor_chunks", "arrival_gives_up", bytes([1 | (2 << 1)]) + tensor_chunks(b"g", b"bf16", 2, values, 13))
write("tensor_chunks", "mailbox_refused", bytes([16]) + tensor_chunks(b"act/0", b"none", 0, values, 1024))
