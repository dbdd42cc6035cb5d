#!/usr/bin/env python3
"""Assembles the `geotrain` Python package in the build tree: the hand-written modules (clients/python/geotrain)
and the modules protoc generates from proto/ (spec.proto and the public API, geotrain/v1/*.proto); with --wheel,
also the wheel that users install with pip (geotrain-VERSION-py3-none-any.whl).

    build_package.py --protoc protoc --grpc-plugin grpc_python_plugin --proto-dir proto \\
        --src clients/python/geotrain --out build/clients/python [--wheel build/clients/python/dist] [--version V]

protoc names a module after its .proto file's path: geotrain/v1/jobs.proto becomes geotrain.v1.jobs_pb2, inside
this package, but spec.proto becomes a top-level spec_pb2. The package keeps it as geotrain.spec_pb2, so the v1
modules' `import spec_pb2` is rewritten to import it from there (the file's descriptor is registered as
"spec.proto" either way). The public .proto files go into the package as well (geotrain/proto/), and the version
into geotrain/_version.py.

The version is the project's one version, GEOTRAIN_VERSION in deploy/CMakeLists.txt (the .deb's), unless
--version gives it. The wheel is pure Python (PEP 427: the package, a .dist-info with METADATA, WHEEL and RECORD
with every file's sha256), written with the standard library only, byte for byte the same for the same inputs.
It depends on grpcio and protobuf (protobuf at least the version the generated modules need).
"""
import argparse
import base64
import glob
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

SOURCE_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
VERSION_FILE = os.path.join(SOURCE_DIR, "deploy", "CMakeLists.txt")
VERSION_PATTERN = re.compile(r"^set\(GEOTRAIN_VERSION\s+([^)\s]+)\s*\)", re.M)
# PEP 440's public versions, the forms this project uses: 1.2.3, 1.2.3rc1, 1.2.3.post1, 1.2.3.dev4.
PEP440 = re.compile(r"^\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?$")
SUMMARY = "Python client of geotrain: submit, follow and plan GPT-2 training jobs on a geo-distributed cluster"


def project_version(path=VERSION_FILE):
    try:
        with open(path) as f:
            match = VERSION_PATTERN.search(f.read())
    except OSError as e:
        raise SystemExit(f"build_package.py: cannot read the version from {path}: {e.strerror}; pass --version")
    if not match:
        raise SystemExit(f"build_package.py: no `set(GEOTRAIN_VERSION X)` in {path}; pass --version")
    return match.group(1)


def assemble(args, version):
    api = sorted(os.path.relpath(f, args.proto_dir)
                 for f in glob.glob(os.path.join(args.proto_dir, "geotrain", "v1", "*.proto")))
    if not api:
        raise SystemExit(f"build_package.py: no geotrain/v1/*.proto under {args.proto_dir}")
    package = os.path.join(args.out, "geotrain")
    os.makedirs(args.out, exist_ok=True)
    staging = tempfile.mkdtemp(prefix="geotrain-python-", dir=args.out)
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
        # The public API's .proto files, as protoc read them (geotrain.proto_dir() is a --proto_path).
        for name in ["spec.proto"] + api:
            os.makedirs(os.path.dirname(os.path.join(assembled, "proto", name)), exist_ok=True)
            shutil.copy(os.path.join(args.proto_dir, name), os.path.join(assembled, "proto", name))
        with open(os.path.join(assembled, "_version.py"), "w") as f:
            f.write(f'"""The geotrain release this package belongs to (deploy/CMakeLists.txt)."""\n'
                    f'__version__ = "{version}"\n')
        # Replace the package whole, so that a module removed from the sources does not linger.
        shutil.rmtree(package, ignore_errors=True)
        os.rename(assembled, package)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return package


def protobuf_requirement(package):
    """The protobuf runtime the generated modules need: what a module generated by protoc >= 26 asks for
    (ValidateProtobufRuntimeVersion), else 3.20 for the `builder` module that protoc 3.20 to 25 generate for."""
    needed = (3, 20, 0)
    for path in sorted(glob.glob(os.path.join(package, "**", "*_pb2.py"), recursive=True)):
        with open(path) as f:
            text = f.read()
        match = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),"
                          r"\s*(\d+),", text)
        if match:
            needed = max(needed, tuple(int(g) for g in match.groups()))
        elif "from google.protobuf.internal import builder" not in text:
            print(f"build_package.py: warning: {path} does not say which protobuf runtime it needs (a protoc older "
                  f"than 3.20?); the wheel requires protobuf without a version", file=sys.stderr)
            return "protobuf"
    return "protobuf>=" + ".".join(str(n) for n in needed)


def grpcio_requirement(package):
    """grpcio, at least the version that generated the stubs when they say (grpc_python_plugin >= 1.63 does)."""
    versions = set()
    for path in glob.glob(os.path.join(package, "**", "*_pb2_grpc.py"), recursive=True):
        with open(path) as f:
            match = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", f.read(), re.M)
        if match:
            versions.add(match.group(1))
    if not versions:
        return "grpcio"
    return "grpcio>=" + max(versions, key=lambda v: [int(n) for n in re.findall(r"\d+", v)])


def record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(package, wheel_dir, version):
    """geotrain-VERSION-py3-none-any.whl in wheel_dir from the assembled package; returns its path."""
    if not PEP440.match(version):
        raise SystemExit(f"build_package.py: '{version}' is not a version pip takes (PEP 440: 1.2.3, 1.2.3rc1, ...)")
    dist_info = f"geotrain-{version}.dist-info"
    readme = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")
    description = ""
    if os.path.exists(readme):
        with open(readme) as f:
            description = f.read()
    metadata = "".join([
        "Metadata-Version: 2.1\n",
        "Name: geotrain\n",
        f"Version: {version}\n",
        f"Summary: {SUMMARY}\n",
        "Requires-Python: >=3.8\n",
        f"Requires-Dist: {grpcio_requirement(package)}\n",
        f"Requires-Dist: {protobuf_requirement(package)}\n",
        "Provides-Extra: pandas\n",
        'Requires-Dist: pandas; extra == "pandas"\n',
        "Description-Content-Type: text/markdown\n",
        "\n",
        description,
    ])
    wheel = ("Wheel-Version: 1.0\n"
             "Generator: geotrain clients/python/build_package.py\n"
             "Root-Is-Purelib: true\n"
             "Tag: py3-none-any\n")

    files = []  # (archive name, bytes), the package first, sorted, then the .dist-info
    root = os.path.dirname(package)
    for directory, subdirs, names in os.walk(package):
        subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
        for name in sorted(names):
            if name.endswith((".pyc", ".pyo")):
                continue
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                files.append((os.path.relpath(path, root).replace(os.sep, "/"), f.read()))
    files.sort(key=lambda item: item[0])
    files += [(f"{dist_info}/METADATA", metadata.encode()), (f"{dist_info}/WHEEL", wheel.encode()),
              (f"{dist_info}/top_level.txt", b"geotrain\n")]
    record = io.StringIO()
    for name, data in files:
        record.write(f"{name},{record_hash(data)},{len(data)}\n")
    record.write(f"{dist_info}/RECORD,,\n")
    files.append((f"{dist_info}/RECORD", record.getvalue().encode()))

    os.makedirs(wheel_dir, exist_ok=True)
    path = os.path.join(wheel_dir, f"geotrain-{version}-py3-none-any.whl")
    fd, partial = tempfile.mkstemp(prefix=".geotrain-wheel-", dir=wheel_dir)
    os.close(fd)
    try:
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, data in files:
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # the same bytes for the same files
                info.compress_type = zipfile.ZIP_DEFLATED
                info.external_attr = (0o100644 & 0xFFFF) << 16
                archive.writestr(info, data)
        os.chmod(partial, 0o644)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    # Wheels of other versions would leave `pip install dist/*.whl` two to choose from.
    for other in glob.glob(os.path.join(wheel_dir, "geotrain-*-py3-none-any.whl")):
        if other != path:
            os.unlink(other)
    return path


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--protoc", required=True)
    p.add_argument("--grpc-plugin", required=True)
    p.add_argument("--proto-dir", required=True)
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--wheel", metavar="DIR", help="also write geotrain-VERSION-py3-none-any.whl into DIR")
    p.add_argument("--version", help=f"the package's version (default: GEOTRAIN_VERSION in {VERSION_FILE})")
    args = p.parse_args(argv)

    version = args.version or project_version()
    if not PEP440.match(version):
        raise SystemExit(f"build_package.py: '{version}' is not a version pip takes (PEP 440: 1.2.3, 1.2.3rc1, ...)")
    package = assemble(args, version)
    if args.wheel:
        print(f"wheel: {write_wheel(package, args.wheel, version)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
