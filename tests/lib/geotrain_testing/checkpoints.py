"""Reading what geotrain writes as weights (numpy): safetensors files and checkpoint step directories
(docs/model.md: checkpoint DIR/step_NNNNNNNN/ with manifest.json and model*.safetensors, DIR/latest naming the
newest complete step)."""
import json
import os
import struct

import numpy as np


def read_safetensors(path):
    """{tensor name: float32 array of its shape} of a safetensors file. Raises ValueError for a tensor that is not
    F32 (geotrain writes only F32)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            raise ValueError(f"{path}: tensor {name} is {info['dtype']}, not F32")
        start, end = info["data_offsets"]
        out[name] = np.frombuffer(data[start:end], dtype=np.float32).reshape(info["shape"])
    return out


def read_step_dir(step_dir):
    """(step, weights) of a checkpoint step directory: its manifest's step, and the tensors of every model file
    its manifest lists."""
    with open(os.path.join(step_dir, "manifest.json")) as f:
        manifest = json.load(f)
    params = {}
    for name in sorted(manifest["files"]):
        if name.startswith("model"):
            params.update(read_safetensors(os.path.join(step_dir, name)))
    return int(manifest["step"]), params


def newest(ckpt):
    """The newest complete step directory of checkpoint directory `ckpt` (the one its `latest` file names)."""
    with open(os.path.join(ckpt, "latest")) as f:
        return os.path.join(ckpt, f.read().strip())
