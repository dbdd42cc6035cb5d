"""Checks which GPU architectures the CUDA objects of a build really carry, without a GPU.

Each object nvcc compiled holds a fat binary (its .nv_fatbin section): one entry per architecture, ELF machine
code (SASS) for each real architecture and PTX for the virtual ones. This reads that section's entries and
checks that every CUDA object of the CUDA ops library (model/cuda/) has machine code for each architecture asked
for, and PTX for the newest (so a GPU newer than the build can compile it at load).
Usage: check_archs.py BUILD_DIR ARCH [ARCH...]      (e.g. check_archs.py build 75 80 86 89 90)
Prints one line per object; exits 1 naming what is missing, 2 when there is nothing to check.
"""
import glob
import os
import struct
import subprocess
import sys
import tempfile

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2


def fatbin_entries(data):
    """(kind, arch) of every entry of the fat binaries in `data` (a .nv_fatbin section)."""
    entries = []
    offset = 0
    while offset + 16 <= len(data):
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, offset)
        if magic != FATBIN_MAGIC:
            raise ValueError(f"no fat binary header at byte {offset} (magic {magic:#x})")
        entry, end = offset + header_size, offset + header_size + fat_size
        while entry < end:
            kind, _unknown, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            arch = struct.unpack_from("<I", data, entry + 28)[0]
            entries.append((kind, arch))
            entry += entry_header + payload
        offset = end
    return entries


def object_entries(path):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "fatbin")
        subprocess.run(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", path, out], check=True)
        with open(out, "rb") as f:
            return fatbin_entries(f.read())


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    build, archs = sys.argv[1], sorted(int(a) for a in sys.argv[2:])
    objects = sorted(glob.glob(os.path.join(build, "model/cuda/CMakeFiles/geotrain_model_cuda.dir/*.cu.o")))
    if not objects:
        print(f"check_archs: no CUDA objects under {build}/model/cuda: is this a CUDA build (GEOTRAIN_CUDA=ON)?")
        return 2
    missing = []
    for path in objects:
        entries = object_entries(path)
        sass = sorted({arch for kind, arch in entries if kind == KIND_ELF})
        ptx = sorted({arch for kind, arch in entries if kind == KIND_PTX})
        name = os.path.basename(path)
        print(f"{name}: machine code for sm_{', sm_'.join(map(str, sass))}; PTX for compute_{', compute_'.join(map(str, ptx))}")
        missing += [f"{name}: no sm_{a} machine code" for a in archs if a not in sass]
        if archs[-1] not in ptx:
            missing.append(f"{name}: no compute_{archs[-1]} PTX")
    if missing:
        print("check_archs: FAILED:\n  " + "\n  ".join(missing))
        return 1
    print(f"check_archs: {len(objects)} objects carry sm_{', sm_'.join(map(str, archs))} and PTX for the newest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
