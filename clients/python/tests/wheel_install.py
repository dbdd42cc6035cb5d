#!/usr/bin/env python3
"""The wheel as users install it (ctest python_wheel): checks the archive (PEP 427: RECORD with every file's sha256,
METADATA with the dependencies, the generated modules and the public .proto files), installs it with pip into a
fresh virtual environment (python3 -m venv --system-site-packages: Debian's grpcio and protobuf; no package index),
imports geotrain from a directory outside the source and build trees, and runs a job to SUCCEEDED through the
installed client on a real `geotrain cluster up` cluster (tests/control/two-sites-5ms.yaml), following it in the
background and reading its step series.

Usage: wheel_install.py WHEEL GEOTRAIN_BIN [PYTHON]   (PYTHON: the interpreter of the venv, default /usr/bin/python3),
with PYTHONPATH=tests/lib (the cluster harness; ctest sets it). The venv's client runs without it.
Exits 77 (skipped) only when the interpreter cannot make a virtual environment with pip (Debian: python3-venv).
Not collected by pytest (its name): clients/python/tests/test_*.py test the package in the build tree.
"""
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

from geotrain_testing.clusters import ClusterUp
from geotrain_testing.shards import write_tiny_corpus

SKIPPED = 77
SOURCE_DIR = os.environ.get("GEOTRAIN_SOURCE_DIR",
                            os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

# Run by the installed client, in the venv, from a directory outside the trees: a tiny job followed in the
# background to its end. Prints one JSON line with what the checks below need.
JOB_SCRIPT = r'''
import json, sys, threading
import geotrain
from geotrain.v1 import jobs_pb2_grpc

corpus, steps = sys.argv[1], int(sys.argv[2])
client = geotrain.Client()
status = client.cluster()
spec = {"name": "from-the-wheel", "model": {"preset": "gpt2-tiny-test"}, "data": {"train": corpus},
        "train": {"global_batch": 8, "seq_len": 16, "steps": steps, "lr": 1e-3, "warmup_steps": 2, "seed": 3},
        "parallel": {"plan": "manual", "dp": 1, "pp": 2, "microbatches": 2, "schedule": "1f1b",
                     "placement": [{"replica": 0, "stage": 0, "site": "site-a"},
                                   {"replica": 0, "stage": 1, "site": "site-b"}]}}
job_id = client.submit(spec)
threads = set()
follower = client.follow(job_id, on_event=lambda event: threads.add(threading.get_ident()))
job = follower.wait(timeout=240)
print(json.dumps({
    "file": geotrain.__file__, "version": geotrain.__version__, "proto_dir": geotrain.proto_dir(),
    "grpc": sys.modules["grpc"].__file__, "protobuf": sys.modules["google.protobuf"].__file__,
    "sites": sorted(s.name for s in status.sites), "job_id": job_id, "state": job.state, "message": job.message,
    "job_type": type(job).__name__, "proto_type": type(job.proto).__name__,
    "steps": [s.step for s in client.steps(job_id)], "followed_steps": [s.step for s in follower.steps],
    "losses": [s.loss for s in client.steps(job_id)], "background": threading.get_ident() not in threads,
}))
'''


def fail(message):
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def check_archive(wheel):
    """The archive itself: its name, RECORD's hashes and sizes, METADATA, and what it holds."""
    match = re.fullmatch(r"geotrain-([^-]+)-py3-none-any\.whl", os.path.basename(wheel))
    if not match:
        fail(f"{wheel}: not a pure-Python wheel's name (geotrain-VERSION-py3-none-any.whl)")
    version = match.group(1)
    dist_info = f"geotrain-{version}.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        if archive.testzip() is not None:
            fail(f"{wheel}: a corrupt member: {archive.testzip()}")
        names = set(archive.namelist())
        record = list(csv.reader(io.StringIO(archive.read(f"{dist_info}/RECORD").decode())))
        recorded = {row[0] for row in record}
        if recorded != names:
            fail(f"RECORD lists {sorted(recorded ^ names)} but the archive does not hold them, or the other way")
        for name, digest, size in record:
            if name == f"{dist_info}/RECORD":
                if digest or size:
                    fail("RECORD gives a hash for itself")
                continue
            data = archive.read(name)
            expected = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            if digest != expected or int(size) != len(data):
                fail(f"RECORD: {name}: {digest} {size}, the file: {expected} {len(data)}")
        metadata = archive.read(f"{dist_info}/METADATA").decode()
        wheel_file = archive.read(f"{dist_info}/WHEEL").decode()
    for line in ("Name: geotrain", f"Version: {version}"):
        if line not in metadata.splitlines():
            fail(f"METADATA lacks '{line}':\n{metadata}")
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    for dependency in ("grpcio", "protobuf"):
        if not any(re.match(rf"{dependency}\b(?!.*extra)", r) for r in requires):
            fail(f"METADATA does not require {dependency}: {requires}")
    for line in ("Wheel-Version: 1.0", "Root-Is-Purelib: true", "Tag: py3-none-any"):
        if line not in wheel_file.splitlines():
            fail(f"WHEEL lacks '{line}':\n{wheel_file}")
    for name in ("geotrain/__init__.py", "geotrain/client.py", "geotrain/results.py", "geotrain/spec_pb2.py",
                 "geotrain/v1/jobs_pb2.py", "geotrain/v1/jobs_pb2_grpc.py", "geotrain/v1/cluster_pb2_grpc.py",
                 "geotrain/v1/planner_pb2_grpc.py", "geotrain/proto/spec.proto",
                 "geotrain/proto/geotrain/v1/jobs.proto", "geotrain/proto/geotrain/v1/cluster.proto",
                 "geotrain/proto/geotrain/v1/planner.proto"):
        if name not in names:
            fail(f"the wheel lacks {name}")
    if any("__pycache__" in n or n.endswith(".pyc") for n in names):
        fail("the wheel holds compiled files")
    return version


def make_venv(python, venv):
    """A virtual environment with pip that sees the system's packages; exits 77 when python3-venv is missing."""
    made = subprocess.run([python, "-m", "venv", "--system-site-packages", venv], capture_output=True, text=True)
    if made.returncode != 0:
        output = made.stdout + made.stderr
        if "ensurepip" in output or "No module named venv" in output or "python3-venv" in output:
            print(f"SKIP: {python} cannot make a virtual environment with pip (apt-get install python3-venv):\n"
                  f"{output.strip()}")
            sys.exit(SKIPPED)
        fail(f"python3 -m venv failed:\n{output}")
    return os.path.join(venv, "bin", "python")


def main(argv):
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    wheel, geotrain_bin = os.path.abspath(argv[0]), os.path.abspath(argv[1])
    python = argv[2] if len(argv) == 3 else "/usr/bin/python3"
    if not os.path.isfile(wheel):
        fail(f"no wheel at {wheel}: the build writes it (target geotrain_python)")
    version = check_archive(wheel)

    work = tempfile.mkdtemp(prefix="geotrain_wheel_")
    up = None
    try:
        # Only what a user's shell would have: no PYTHONPATH into the trees, no user site-packages.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "GEOTRAIN_"))}
        env.update(PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
                   PIP_NO_INDEX="1", PIP_NO_CACHE_DIR="1")
        venv = os.path.join(work, "venv")
        venv_python = make_venv(python, venv)
        # No --no-deps: pip must find grpcio and protobuf, as the wheel requires them, among the system's packages.
        installed = subprocess.run([venv_python, "-m", "pip", "install", "--no-index", wheel], capture_output=True,
                                   text=True, env=env, cwd=work)
        if installed.returncode != 0:
            fail(f"pip install {wheel} failed:\n{installed.stdout}\n{installed.stderr}")
        print(installed.stdout.strip().splitlines()[-1])
        shown = subprocess.run([venv_python, "-m", "pip", "show", "geotrain"], capture_output=True, text=True,
                               env=env, cwd=work).stdout
        if f"Version: {version}" not in shown or "grpcio" not in shown or "protobuf" not in shown:
            fail(f"pip show geotrain:\n{shown}")

        up = ClusterUp(geotrain_bin, os.path.join(SOURCE_DIR, "tests", "control", "two-sites-5ms.yaml"))
        corpus = write_tiny_corpus(os.path.join(work, "data"))
        outside = os.path.join(work, "elsewhere")  # the working directory: no geotrain/ next to it
        os.makedirs(outside)
        env["GEOTRAIN_HOME"] = up.home  # the cluster record: the head's address and token file, as for the CLI
        steps = 3
        ran = subprocess.run([venv_python, "-c", JOB_SCRIPT, corpus, str(steps)], capture_output=True, text=True,
                             env=env, cwd=outside, timeout=280)
        if ran.returncode != 0:
            fail(f"the job through the installed client failed:\n{ran.stdout}\n{ran.stderr}\n{up.process_logs()}")
        result = json.loads(ran.stdout.strip().splitlines()[-1])
        site_packages = os.path.join(venv, "lib")
        if not result["file"].startswith(site_packages + os.sep) or "site-packages" not in result["file"]:
            fail(f"geotrain was imported from {result['file']}, not from the venv's site-packages")
        if result["version"] != version:
            fail(f"geotrain.__version__ is {result['version']}, the wheel's {version}")
        if not os.path.isfile(os.path.join(result["proto_dir"], "geotrain", "v1", "jobs.proto")):
            fail(f"no geotrain/v1/jobs.proto in the installed package's proto_dir() {result['proto_dir']}")
        if result["state"] != "SUCCEEDED":
            fail(f"{result['job_id']}: {result['state']}: {result['message']}\n{up.process_logs()}")
        if result["job_type"] != "JobStatus" or result["proto_type"] != "Job":
            fail(f"status is a {result['job_type']} with a {result['proto_type']}, not a JobStatus with a Job")
        expected = list(range(1, steps + 1))
        if result["steps"] != expected or result["followed_steps"] != expected:
            fail(f"steps {result['steps']}, followed {result['followed_steps']}, not {expected}")
        if not all(loss > 0 for loss in result["losses"]) or result["sites"] != ["site-a", "site-b"]:
            fail(f"losses {result['losses']}, sites {result['sites']}")
        if not result["background"]:
            fail("on_event ran in the caller's thread, not in the follower's")
        print(f"python_wheel: {os.path.basename(wheel)} installed in a venv (grpcio from {result['grpc']}), "
              f"imported from {result['file']}, {result['job_id']} SUCCEEDED in {steps} steps through it")
        return 0
    finally:
        if up is not None:
            up.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
