"""Token shards in llm.c's .bin layout, as `geotrain data prepare` writes them and the trainer reads them
(docs/model.md): a header of 256 little-endian int32 (magic 20240520, version 1, the token count, zeros), then
the tokens as little-endian uint16. The one writer of that layout for tests and benchmarks, and the small
learnable corpora they train on."""
import array
import os
import random
import struct
import sys

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256


def write_token_shard(path, tokens):
    """Writes `tokens` (ints, or a numpy integer array) to `path` as one shard. Raises OverflowError when a token
    does not fit in uint16 (a vocabulary over 65536 cannot be stored in this layout)."""
    body = array.array("H", tokens)
    if body.itemsize != 2:
        raise RuntimeError(f"array 'H' holds {body.itemsize}-byte items here; the shard layout needs 2")
    if sys.byteorder != "little":
        body.byteswap()
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{HEADER_INTS}i", MAGIC, VERSION, len(body), *([0] * (HEADER_INTS - 3))))
        f.write(body.tobytes())


def write_tiny_corpus(directory, vocab=512, length=97, repeats=200, seed=5):
    """A small learnable corpus (a sequence of `length` tokens repeated `repeats` times, 10% of them replaced by
    noise) as one train shard in `directory`; returns its glob (directory/train_*.bin) for a job spec."""
    rng = random.Random(seed)
    base = [rng.randrange(vocab) for _ in range(length)]
    tokens = [rng.randrange(vocab) if rng.random() < 0.1 else t for _ in range(repeats) for t in base]
    os.makedirs(directory, exist_ok=True)
    write_token_shard(os.path.join(directory, "train_000000.bin"), tokens)
    return os.path.join(directory, "train_*.bin")


def write_pattern_shard(path, n, vocab, seed=3):
    """One shard of `n` tokens: a 97-token pattern repeated, each token replaced by noise with probability 0.1.
    The benchmarks' stream (bench/geo/, bench/comm/): the same seed gives the same tokens as their recorded runs."""
    rng = random.Random(seed)
    base = [rng.randrange(vocab) for _ in range(97)]
    write_token_shard(path, [(base[i % 97] if rng.random() > 0.1 else rng.randrange(vocab)) for i in range(n)])
