#!/usr/bin/python3
"""Builds the training text for tools/train from installed Debian packages (issue 29).

Sources (every one from Debian main, so DFSG-free: redistribution and derived works allowed):
  * man pages (English sections 1-9 under /usr/share/man), roff stripped here;
  * Python 3.11 documentation (python3.11-doc: the reStructuredText sources);
  * the Debian Reference (debian-reference-en, HTML stripped);
  * the King James Bible (bible-kjv-text, via the `bible` program), one document per book;
  * plain-text, Markdown and HTML documentation under /usr/share/doc (no changelogs, no
    copyright files).
Each document is attributed to the package that ships it (dpkg's file lists) and the package's
license is read from /usr/share/doc/<pkg>/copyright. Whole documents are held out (a hash of the
document's path picks ~3 %), never windows.

Writes OUT/train.jsonl, OUT/heldout.jsonl ({"pkg", "path", "text"} per line) and
OUT/manifest.md (every package with its license and bytes).

  /usr/bin/python3 tools/train/prepare_data.py --out /work/train-run/data
"""

import argparse
import collections
import glob
import gzip
import hashlib
import html
import json
import os
import re
import subprocess
import sys

HELDOUT_PERCENT = 3
# Installed from outside Debian main (Google's and NodeSource's archives) or not text: skipped.
EXCLUDED_PACKAGES = {"google-cloud-cli", "google-cloud-sdk", "nodejs", "fonts-dejavu-core"}
# No package may dominate the mix: documents past this many bytes per package are dropped
# (in a fixed hash order, so the choice does not depend on the file system's order).
MAX_BYTES_PER_PACKAGE = 12_000_000


def read_maybe_gz(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    return data.decode("utf-8", errors="replace")


# ---------------------------------------------------------------- roff (man pages)
_ESCAPES = [
    (re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""),  # font changes
    (re.compile(r"\\s[+-]?\d+"), ""),  # size changes
    (re.compile(r"\\\*(\[[^\]]*\]|\(..|.)"), ""),  # strings
    (re.compile(r"\\\((em|en)"), "--"),
    (re.compile(r"\\\((lq|rq|dq)"), '"'),
    (re.compile(r"\\\((oq|cq|aq)"), "'"),
    (re.compile(r"\\\((bu)"), "*"),
    (re.compile(r"\\\((co)"), "(C)"),
    (re.compile(r"\\\((mu)"), "x"),
    (re.compile(r"\\\((ti)"), "~"),
    (re.compile(r"\\\((ha)"), "^"),
    (re.compile(r"\\\((>=)"), ">="),
    (re.compile(r"\\\((<=)"), "<="),
    (re.compile(r"\\\((->)"), "->"),
    (re.compile(r"\\\(.."), ""),
    (re.compile(r"\\\[[^\]]*\]"), ""),
    (re.compile(r"\\[-]"), "-"),
    (re.compile(r"\\[e\\]"), "\\\\"),
    (re.compile(r"\\[&|^c%:]"), ""),
    (re.compile(r"\\[ ~0]"), " "),
    (re.compile(r"\\[nkhvwoNzxXYbDlLRS]('[^']*'|\[[^\]]*\]|\(..|.)?"), ""),
    (re.compile(r"\\(.)"), r"\1"),
]
_MDOC_WORD = re.compile(r"\b(Ar|Fl|Op|Oo|Oc|Nm|Pa|Cm|Ic|Ql|Sq|Dq|Pq|Li|Em|Sy|Xr|Ns|Ev|Va|Fn|Fa|Ft|"
                        r"Dv|Er|Bq|Brq|Aq|Ek|Ux|Bx|At|Ta|No|Ad|Lk|Mt|Tn|Cd|Fd)\b ?")
_BREAK_MACROS = {"PP", "P", "LP", "sp", "br", "TP", "Pp", "Bl", "El", "Bd", "Ed", "RS", "RE", "nf",
                 "fi", "IP", "HP", "TQ", "Sh", "Ss", "SH", "SS", "It", "Lp"}
_TEXT_MACROS = {"B", "I", "BR", "RB", "BI", "IB", "IR", "RI", "SM", "SB", "IP", "TP", "SH", "SS",
                "Sh", "Ss", "Nd", "It", "Dl", "D1", "UR", "MT", "TQ", "Nm", "Fl", "Ar", "Op", "Pa",
                "Xr", "Cm", "Ic", "Ql", "Dq", "Sq", "Pq", "Li", "Em", "Sy", "Ev", "Va", "Fn", "Fa",
                "Ft", "Dv", "Er", "Ad", "Cd", "Fd", "Tn", "No", "Bq", "Aq", "Lk", "Mt"}


def _unescape_roff(s):
    for pat, rep in _ESCAPES:
        s = pat.sub(rep, s)
    return s


def _macro_args(rest):
    args = re.findall(r'"([^"]*)"|(\S+)', rest)
    return [a or b for a, b in args]


def deroff(text):
    out = []
    for line in text.split("\n"):
        if line.startswith(('.\\"', "'\\\"", '.\\\'', "\\\"")):
            continue
        if line.startswith((".", "'")):
            m = re.match(r"[.'](\S+)\s*(.*)", line)
            if not m:
                continue
            name, rest = m.group(1), m.group(2)
            if name == "so":
                return None  # an alias of another page
            if name in _BREAK_MACROS:
                out.append("")
            if name in _TEXT_MACROS and rest:
                if name in ("BR", "RB", "BI", "IB", "IR", "RI"):
                    words = "".join(_macro_args(rest))
                else:
                    words = " ".join(_macro_args(_MDOC_WORD.sub("", rest)))
                if name == "Fl":
                    words = "-" + words
                out.append(_unescape_roff(words))
            continue
        out.append(_unescape_roff(line))
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


# ---------------------------------------------------------------- HTML
_SCRIPT = re.compile(r"<(script|style|head)\b.*?</\1>", re.S | re.I)
_BLOCK = re.compile(r"</?(p|div|br|h[1-6]|li|tr|pre|table|dt|dd|ul|ol|section|blockquote)\b[^>]*>",
                    re.I)
_TAG = re.compile(r"<[^>]+>")


def strip_html(text):
    text = _SCRIPT.sub("", text)
    text = _BLOCK.sub("\n", text)
    text = _TAG.sub("", text)
    text = html.unescape(text)
    text = re.sub(r"[ \t\r]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


# ---------------------------------------------------------------- packages and licenses
def file_owners():
    owners = {}
    for lst in glob.glob("/var/lib/dpkg/info/*.list"):
        pkg = os.path.basename(lst)[:-5].split(":")[0]
        with open(lst, errors="replace") as f:
            for line in f:
                owners[line.rstrip("\n")] = pkg
    return owners


_LICENSE_KEYWORDS = [("GPL-3", r"GNU GENERAL PUBLIC LICENSE\s+Version 3|GPL-3|GPLv3"),
                     ("GPL-2", r"GNU GENERAL PUBLIC LICENSE\s+Version 2|GPL-2|GPLv2"),
                     ("LGPL", r"LGPL|Lesser General Public"), ("BSD", r"\bBSD\b"),
                     ("MIT", r"\bMIT\b|Expat"), ("Apache-2.0", r"Apache"),
                     ("GFDL", r"GFDL|Free Documentation License"),
                     ("PSF", r"PSF|Python Software Foundation License"),
                     ("public-domain", r"[Pp]ublic [Dd]omain")]


def package_license(pkg, cache={}):
    if pkg in cache:
        return cache[pkg]
    path = f"/usr/share/doc/{pkg}/copyright"
    lic = None
    if os.path.exists(path):
        text = open(path, errors="replace").read()
        names = []
        for m in re.finditer(r"^License:\s*(\S.*)$", text, re.M):
            n = m.group(1).strip()
            if len(n) > 40 or " " in n.replace(" or ", "").replace(" and ", "").replace(
                    " with ", ""):
                continue  # the license's text, not its short name
            if n not in names:
                names.append(n)
        if not names or len(names) < 2:
            names += [n for n, pat in _LICENSE_KEYWORDS if re.search(pat, text) and
                      n not in names]
        lic = ", ".join(names[:6]) if names else "see copyright (Debian main, DFSG-free)"
    cache[pkg] = lic
    return lic


# ---------------------------------------------------------------- sources
def _hash_order(path):
    return hashlib.sha1(path.encode()).hexdigest()


def man_docs():
    for path in sorted(glob.glob("/usr/share/man/man[1-9]*/*"), key=_hash_order):
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        try:
            text = deroff(read_maybe_gz(path))
        except (OSError, EOFError):
            continue
        if text and len(text) > 200:
            yield path, text


def python_docs():
    for path in sorted(glob.glob("/usr/share/doc/python3.11/html/_sources/**/*.rst.txt",
                                 recursive=True)):
        yield path, open(path, errors="replace").read()


def debian_reference_docs():
    for path in sorted(glob.glob("/usr/share/debian-reference/*.en.html")):
        yield path, strip_html(open(path, errors="replace").read())


def bible_docs():
    env = dict(os.environ, COLUMNS="100000")
    out = subprocess.run(["bible", "-l100000", "Ge1:1-Re22:21"], capture_output=True, text=True,
                         env=env, check=True).stdout
    # Output: "Genesis 1" headings, then "  1 In the beginning ..." verses.
    books = collections.OrderedDict()
    book = None
    for line in out.split("\n"):
        m = re.match(r"^(\S.*?) (\d+)$", line)
        if m:
            book = m.group(1)
            books.setdefault(book, []).append(f"\nChapter {m.group(2)}\n")
        elif line.strip() and book is not None:
            books[book].append(line.strip())
    for book, lines in books.items():
        yield f"/usr/lib/bible.data#{book}", book + "\n" + "\n".join(lines) + "\n"


_DOC_NAME = re.compile(r"(\.txt|\.md|\.rst|\.html?|README[^/]*|NEWS|FAQ[^/]*)(\.gz)?$", re.I)


def usr_share_doc_docs():
    for path in sorted(glob.glob("/usr/share/doc/*/**/*", recursive=True), key=_hash_order):
        if path.startswith("/usr/share/doc/python3.11/html/"):
            continue
        base = os.path.basename(path).lower()
        if "changelog" in base or base.startswith("copyright") or "license" in base:
            continue
        if os.path.islink(path) or not os.path.isfile(path) or not _DOC_NAME.search(path):
            continue
        try:
            text = read_maybe_gz(path)
        except (OSError, EOFError):
            continue
        if re.search(r"\.html?(\.gz)?$", path, re.I):
            text = strip_html(text)
        if len(text) > 200:
            yield path, text


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--manifest_only", action="store_true",
                    help="rewrite OUT/manifest.md from OUT/*.jsonl")
    args = ap.parse_args()
    if args.manifest_only:
        return write_manifest_from_jsonl(args.out)
    os.makedirs(args.out, exist_ok=True)
    owners = file_owners()
    stats = collections.defaultdict(lambda: [0, 0, 0])  # pkg -> [docs, bytes, heldout docs]
    kinds = collections.Counter()
    seen = set()
    with open(os.path.join(args.out, "train.jsonl"), "w") as tr, \
            open(os.path.join(args.out, "heldout.jsonl"), "w") as ho:
        for kind, gen in [("bible", bible_docs()), ("python-doc", python_docs()),
                          ("debian-reference", debian_reference_docs()), ("man", man_docs()),
                          ("usr-share-doc", usr_share_doc_docs())]:
            for path, text in gen:
                real = path.split("#")[0]
                pkg = owners.get(real) or owners.get(os.path.realpath(real))
                if pkg is None or pkg in EXCLUDED_PACKAGES or package_license(pkg) is None:
                    continue  # not from a Debian main package with a copyright file
                if stats[pkg][1] + len(text.encode()) > MAX_BYTES_PER_PACKAGE:
                    continue
                digest = hashlib.sha1(text.encode()).hexdigest()
                if digest in seen:
                    continue
                seen.add(digest)
                held = int(hashlib.sha1(path.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT
                rec = json.dumps({"pkg": pkg, "path": path, "text": text})
                (ho if held else tr).write(rec + "\n")
                s = stats[pkg]
                s[0] += 1
                s[1] += len(text.encode())
                s[2] += held
                kinds[kind] += len(text.encode())
            print(kind, kinds[kind], file=sys.stderr, flush=True)
    write_manifest(args.out, stats, kinds)


def _kind(path):
    if path.startswith("/usr/lib/bible.data"):
        return "bible"
    if path.startswith("/usr/share/doc/python3.11/html/_sources/"):
        return "python-doc"
    if path.startswith("/usr/share/debian-reference/"):
        return "debian-reference"
    if path.startswith("/usr/share/man/"):
        return "man"
    return "usr-share-doc"


def write_manifest_from_jsonl(out):
    stats = collections.defaultdict(lambda: [0, 0, 0])
    kinds = collections.Counter()
    for split in ("train", "heldout"):
        with open(os.path.join(out, f"{split}.jsonl")) as f:
            for line in f:
                rec = json.loads(line)
                n = len(rec["text"].encode())
                s = stats[rec["pkg"]]
                s[0] += 1
                s[1] += n
                s[2] += split == "heldout"
                kinds[_kind(rec["path"])] += n
    write_manifest(out, stats, kinds)


def write_manifest(out, stats, kinds):
    with open(os.path.join(out, "manifest.md"), "w") as f:
        total = sum(s[1] for s in stats.values())
        f.write("# Training text manifest (tools/train/prepare_data.py)\n\n")
        f.write(f"{total:,} bytes in {sum(s[0] for s in stats.values()):,} documents from "
                f"{len(stats)} Debian main packages; held out by document: "
                f"{sum(s[2] for s in stats.values()):,} documents.\n\n")
        f.write("| source kind | bytes |\n|---|---|\n")
        for k, v in kinds.items():
            f.write(f"| {k} | {v:,} |\n")
        f.write("\n| package | documents | held out | bytes | license (its copyright file) |\n"
                "|---|---|---|---|---|\n")
        for pkg in sorted(stats, key=lambda p: -stats[p][1]):
            d, b, h = stats[pkg]
            f.write(f"| {pkg} | {d} | {h} | {b:,} | {package_license(pkg)} |\n")
    print("total bytes", total, file=sys.stderr)


if __name__ == "__main__":
    main()
