"""Every relative link of the docs resolves: the file (or folder) exists and a #anchor names one of its headings,
as GitHub forms heading ids. Usage: check_doc_links.py SOURCE_DIR (checks README.md, docs/*.md, docs/results/*.md).
Prints each broken link with its file and line; exits 1 when one is broken."""
import glob
import os
import re
import sys

LINK = re.compile(r'!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')


def lines_outside_fences(path):
    fenced = False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if not fenced:
                yield number, line


def heading_ids(path):
    ids, seen = set(), {}
    for _, line in lines_outside_fences(path):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(2)).replace("`", "").replace("*", "")
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids


def main():
    root = sys.argv[1]
    files = [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    files += sorted(glob.glob(os.path.join(root, "docs", "results", "*.md")))
    broken = checked = 0
    for path in files:
        for number, line in lines_outside_fences(path):
            for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
                target = m.group(1)
                if re.match(r"^[a-z]+:", target):
                    continue
                checked += 1
                where, _, anchor = target.partition("#")
                full = os.path.normpath(os.path.join(os.path.dirname(path), where)) if where else path
                rel = os.path.relpath(path, root)
                if not os.path.exists(full):
                    print(f"{rel}:{number}: {target}: no such file")
                    broken += 1
                elif anchor and full.endswith(".md") and anchor not in heading_ids(full):
                    print(f"{rel}:{number}: {target}: no heading #{anchor} in {os.path.relpath(full, root)}")
                    broken += 1
    print(f"{checked} links in {len(files)} files checked, {broken} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
