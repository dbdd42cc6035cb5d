"""The Python client's tests drive a real `geotrain cluster up` cluster (tests/control/two-sites-5ms.yaml: two
sites 5 ms apart, two emulated T4 workers each), started once for the session in a temporary GEOTRAIN_HOME, so
that geotrain.Client() finds its head as the CLI does. ctest runs them (clients/python/CMakeLists.txt) with
GEOTRAIN_BIN (the geotrain binary), GEOTRAIN_SOURCE_DIR and PYTHONPATH (the test package tests/lib, for the cluster
harness, and the package in the build tree)."""
import os

import pytest

from geotrain_testing.clusters import ClusterUp
from geotrain_testing.shards import write_tiny_corpus

SOURCE_DIR = os.environ.get("GEOTRAIN_SOURCE_DIR",
                            os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

TOPOLOGY = os.path.join(SOURCE_DIR, "tests", "control", "two-sites-5ms.yaml")


@pytest.fixture(scope="session")
def cluster():
    geotrain = os.environ.get("GEOTRAIN_BIN")
    if not geotrain:
        pytest.fail("set GEOTRAIN_BIN to the geotrain binary (ctest does)")
    up = ClusterUp(geotrain, TOPOLOGY)
    saved = {name: os.environ.get(name) for name in ("GEOTRAIN_HOME", "GEOTRAIN_HEAD", "GEOTRAIN_TOKEN",
                                                     "GEOTRAIN_TOKEN_FILE")}
    for name in saved:
        os.environ.pop(name, None)
    os.environ["GEOTRAIN_HOME"] = up.home
    try:
        yield up
    except BaseException:
        print(up.process_logs())
        raise
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        up.close()


@pytest.fixture(scope="session")
def corpus(cluster):
    return write_tiny_corpus(os.path.join(cluster.home, "data"))


def tiny_spec(name, data, steps=6, parallel=None):
    """A job spec (a dict in the file's shape) small enough for a test: a 2-layer model, 8 x 16 tokens a step."""
    return {
        "name": name,
        "model": {"preset": "gpt2-tiny-test"},
        "data": {"train": data},
        "train": {"global_batch": 8, "seq_len": 16, "steps": steps, "lr": 1e-3, "warmup_steps": 2, "seed": 3},
        # Stage 0 at site-a, stage 1 at site-b: activations and their gradients cross the emulated WAN.
        "parallel": parallel or {"plan": "manual", "dp": 1, "pp": 2, "microbatches": 2, "schedule": "1f1b",
                                 "placement": [{"replica": 0, "stage": 0, "site": "site-a"},
                                               {"replica": 0, "stage": 1, "site": "site-b"}]},
        "comm": {"wan_codec": "bf16"},
    }
