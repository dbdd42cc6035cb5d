#!/usr/bin/env python3
"""Checks the folder dependency table of docs/architecture.md against the code.

For each C++ folder of the table, the folders its files include (`#include "<folder>/..."`; a generated
protobuf header `*.pb.h` counts as proto/) must be exactly the ones its "depends on" cell names: an include
the table does not allow is a dependency running the wrong way, and a folder the table names that nothing
includes is a stale row. Either one fails the check with a line that says what to change.
"""
import argparse
import os
import re
import sys

CPP_FOLDERS = ("proto", "common", "model", "comm", "scheduler", "worker", "head", "netem", "cli")
INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def table(architecture_md):
    """Returns {folder: set of folders it may depend on, or None for 'everything'}."""
    rows = {}
    in_table = False
    with open(architecture_md, encoding="utf-8") as f:
        for line in f:
            if re.match(r"^\|\s*folder\s*\|.*\|\s*depends on\s*\|", line):
                in_table = True
                continue
            if in_table and not line.startswith("|"):
                break
            if not in_table or re.match(r"^\|[-| ]+\|$", line.strip()):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            folders = [f.strip("/") for f in re.findall(r"[\w/]+/", cells[0])]
            deps_cell = cells[-1]
            if re.search(r"\b(everything|anything)\b", deps_cell):
                deps = None
            else:
                # Parenthesised notes say what of a folder is used; the folder names are outside them.
                bare = re.sub(r"\([^)]*\)", "", deps_cell)
                deps = {w for w in re.findall(r"[a-z]+", bare) if w in CPP_FOLDERS}
            for folder in folders:
                rows[folder] = deps
    return rows


def includes(root, folder):
    """Returns {dependency folder: first file that includes it} for the files of `folder`."""
    found = {}
    for dirpath, _, names in os.walk(os.path.join(root, folder)):
        for name in sorted(names):
            if not name.endswith((".cc", ".h", ".cu", ".cpp")):
                continue
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            for header in INCLUDE_RE.findall(text):
                if header.endswith(".pb.h"):
                    dep = "proto"
                else:
                    dep = header.split("/", 1)[0] if "/" in header else ""
                if dep in CPP_FOLDERS and dep != folder:
                    found.setdefault(dep, os.path.relpath(path, root))
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    args = parser.parse_args()
    architecture = os.path.join(args.root, "docs", "architecture.md")
    rows = table(architecture)
    problems = []
    for folder in CPP_FOLDERS:
        if folder not in rows:
            problems.append(f"docs/architecture.md: the dependency table has no row for {folder}/: add one")
            continue
        allowed = rows[folder]
        actual = includes(args.root, folder)
        if allowed is None:
            continue
        for dep, path in sorted(actual.items()):
            if dep not in allowed:
                problems.append(
                    f"{path} includes {dep}/, but docs/architecture.md says {folder}/ depends on "
                    f"{', '.join(sorted(allowed)) or 'nothing'}: remove the include or, if the dependency "
                    "is meant, add it to the table")
        for dep in sorted(allowed - set(actual)):
            problems.append(
                f"docs/architecture.md says {folder}/ depends on {dep}/, but nothing in {folder}/ includes it: "
                "remove it from the table")
    for problem in problems:
        print(problem)
    if not problems:
        print(f"{len(CPP_FOLDERS)} folders: their includes match docs/architecture.md's table")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
