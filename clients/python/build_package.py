#!/usr/bin/env python3
"""Assembles the `geotrain` Python package in the build tree: the hand-written modules (clients/python/geotrain)
and the modules protoc generates from proto/ (spec.proto and the public API, geotrain/v1/*.proto).

    build_package.py --protoc protoc --grpc-plugin grpc_python_plugin --proto-dir proto \\
        --src clients/python/geotrain --out build/clients/python

protoc names a module after its .proto file's path: geotrain/v1/jobs.proto becomes geotrain.v1.jobs_pb2, inside
this package, but spec.proto becomes a top-level spec_pb2. The package keeps it as geotrain.spec_pb2, so the v1
modules' `import spec_pb2` is rewritten to import it from there (the file's descriptor is registered as
"spec.proto" either way).
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--protoc", required=True)
    p.add_argument("--grpc-plugin", required=True)
    p.add_argument("--proto-dir", required=True)
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    api = sorted(os.path.relpath(f, args.proto_dir)
                 for f in glob.glob(os.path.join(args.proto_dir, "geotrain", "v1", "*.proto")))
    package = os.path.join(args.out, "geotrain")
    staging = tempfile.mkdtemp(prefix="geotrain-python-", dir=args.out if os.path.isdir(args.out) else None)
    try:
        generated = os.path.join(staging, "generated")
        os.makedirs(generated)
        subprocess.run([args.protoc, f"--proto_path={args.proto_dir}", f"--python_out={generated}", "spec.proto"]
                       + api, check=True)
        subprocess.run([args.protoc, f"--proto_path={args.proto_dir}", f"--grpc_python_out={generated}",
                        f"--plugin=protoc-gen-grpc_python={args.grpc_plugin}"] + api, check=True)
        assembled = os.path.join(staging, "geotrain")
        shutil.copytree(args.src, assembled, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        shutil.copy(os.path.join(generated, "spec_pb2.py"), assembled)
        shutil.copytree(os.path.join(generated, "geotrain", "v1"), os.path.join(assembled, "v1"))
        with open(os.path.join(assembled, "v1", "__init__.py"), "w") as f:
            f.write('"""geotrain\'s public API, version 1: modules generated from proto/geotrain/v1/*.proto."""\n')
        for path in glob.glob(os.path.join(assembled, "v1", "*.py")):
            with open(path) as f:
                text = f.read()
            text = re.sub(r"^import spec_pb2 as ", "from geotrain import spec_pb2 as ", text, flags=re.M)
            with open(path, "w") as f:
                f.write(text)
        # Replace the package whole, so that a module removed from the sources does not linger.
        shutil.rmtree(package, ignore_errors=True)
        os.makedirs(args.out, exist_ok=True)
        os.rename(assembled, package)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
