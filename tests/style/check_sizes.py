#!/usr/bin/env python3
"""Checks the size rules of style.md on the product's C++: no function body over
--max-function lines and no source file over --max-file lines.

A small C++ scanner, not a compiler: comments, string and character literals are
blanked, then braces are matched. A brace opened outside any function whose
statement carries a parameter list (and is not a namespace, class, enum or an
initialiser after `=`) opens a function body; its length is the number of lines
from the signature's first line to the closing brace. Lambdas and local classes
count towards the function that holds them.

Exit status 1 and one line per offence when a rule is broken; --report lists the
longest functions whatever their size.
"""
import argparse
import os
import re
import sys

FOLDERS = ("cli", "comm", "common", "head", "model", "netem", "scheduler", "worker")
EXTENSIONS = (".cc", ".h", ".cu", ".cpp")


def blank_comments_and_literals(text):
    """Returns text with comments, strings and chars replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = ")" + m.group(1) + '"'
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # digit separator 1'000
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


SCOPE_RE = re.compile(r"^\s*(template\s*<.*>\s*)?(namespace|class|struct|union|enum|extern)\b", re.S)


def functions(path):
    """Yields (name, first_line, line_count) for each function body in path."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = blank_comments_and_literals(f.read())
    # Preprocessor lines are not statements.
    text = re.sub(r"(?m)^[ \t]*#.*(?:\\\n.*)*", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    stack = []  # entries: ("scope"|"function"|"block", start_line, name)
    statement_start = 0
    line = 1
    for i, c in enumerate(text):
        if c == "\n":
            line += 1
        elif c in ";":
            if not any(kind == "function" for kind, _, _ in stack):
                statement_start = i + 1
        elif c == "{":
            in_function = any(kind == "function" for kind, _, _ in stack)
            if in_function:
                stack.append(("block", line, ""))
                continue
            statement = text[statement_start:i]
            body = statement.strip()
            is_function = (
                "(" in body
                and not SCOPE_RE.match(body)
                and "=" not in body.split("(")[0]
                and not body.endswith("=")
            )
            if is_function:
                first = line - statement[len(statement) - len(statement.lstrip()):].count("\n")
                first = line - text[statement_start:i].strip().count("\n")
                name = re.findall(r"([~\w:]+)\s*\(", body)
                stack.append(("function", first, name[0] if name else "?"))
            else:
                stack.append(("scope", line, ""))
            statement_start = i + 1
        elif c == "}":
            if not stack:
                continue
            kind, start, name = stack.pop()
            if kind == "function":
                yield name, start, line - start + 1
            if not any(k == "function" for k, _, _ in stack):
                statement_start = i + 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    parser.add_argument("--max-function", type=int, default=120)
    parser.add_argument("--max-file", type=int, default=900)
    parser.add_argument("--report", type=int, default=0, help="print the N longest functions")
    args = parser.parse_args()
    found = []
    offences = []
    for folder in FOLDERS:
        for dirpath, _, names in os.walk(os.path.join(args.root, folder)):
            for name in sorted(names):
                if not name.endswith(EXTENSIONS):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, args.root)
                with open(path, encoding="utf-8", errors="replace") as f:
                    lines = sum(1 for _ in f)
                if lines > args.max_file:
                    offences.append(f"{rel}: {lines} lines; the limit is {args.max_file}: split it along its parts")
                for fn, start, count in functions(path):
                    found.append((count, rel, start, fn))
                    if count > args.max_function:
                        offences.append(
                            f"{rel}:{start}: {fn} is {count} lines; the limit is {args.max_function}: "
                            "cut it along its phases into named functions")
    for count, rel, start, fn in sorted(found, reverse=True)[: args.report]:
        print(f"{count:5d} {rel}:{start} {fn}")
    for offence in offences:
        print(offence)
    if not args.report:
        print(f"{len(found)} functions checked; {len(offences)} over the limits")
    return 1 if offences and not args.report else 0


if __name__ == "__main__":
    sys.exit(main())
