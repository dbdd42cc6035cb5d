"""Token shards and checkpoint directories for integration tests (numpy): write a shard, read the weights of a
checkpoint step directory."""
import json
import os
import struct

import numpy as np


def write_shard(path, tokens):
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = np.frombuffer(data[start:end], dtype=np.float32).reshape(info["shape"])
    return out


def read_step_dir(step_dir):
    """The weights of a checkpoint step directory (every model file its manifest lists)."""
    with open(os.path.join(step_dir, "manifest.json")) as f:
        manifest = json.load(f)
    params = {}
    for name in sorted(manifest["files"]):
        if name.startswith("model"):
            params.update(read_safetensors(os.path.join(step_dir, name)))
    return int(manifest["step"]), params


def newest(ckpt):
    with open(os.path.join(ckpt, "latest")) as f:
        return os.path.join(ckpt, f.read().strip())
