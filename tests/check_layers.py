#!/usr/bin/python3
"""Checks the include graph: layers point one way (server -> trie -> codec, client -> codec;
only server and client, and the tests and benches above them, use the generated proto code).

Reads every `#include "..."` and `#include <...>` line of every C/C++ source under the layer
folders below, maps the included path to a layer by its first component, and fails (exit 1,
one line per violation: file:line: what it includes and what the layer may include) when a file
includes a layer that its own layer's rule does not allow. Paths that are no layer (the standard
library, absl, gtest, ...) are not checked, except the external libraries in EXTERNAL.

Inside codec/ it checks the codec's own layers (CODEC_LAYERS, lowest first): every codec source
file belongs to a module placed in one layer, no include points from a module to a module of a
higher layer, and the modules' include graph has no cycle (not even inside one layer). Tests,
test helpers (testing_*.h) and fuzzers sit above every layer; no library file includes them.

Before checking the repository it checks itself on synthetic trees with known violations, so a
rule table or parser that stops matching anything fails the test too.

Usage: tests/check_layers.py [REPO_ROOT]   (default: the folder above this script)
       tests/check_layers.py --codec-stats [REPO_ROOT]   (counts only, never fails: modules in
           include cycles and their lines, upward includes, files in no layer)
"""

import os
import re
import sys
import tempfile

# Layer of a file = its first path component (client/worker and client/python are client).
# Each layer may include the layers listed (its own included).
ALLOWED = {
    "codec": {"codec"},
    "trie": {"trie", "codec"},
    "server": {"server", "trie", "codec", "proto"},
    "client": {"client", "codec", "proto"},
    "tests": {"tests", "server", "trie", "codec", "client", "proto"},
    "bench": {"bench", "tests", "server", "trie", "codec", "client", "proto"},
}
# Included path prefix -> layer. "kvtrie/v1/" is the generated code of proto/kvtrie/v1/*.proto.
INCLUDE_LAYER = [
    ("kvtrie/v1/", "proto"),
    ("codec/", "codec"),
    ("trie/", "trie"),
    ("server/", "server"),
    ("client/", "client"),
    ("tests/", "tests"),
    ("bench/", "bench"),
]
# External libraries that belong to one layer: RocksDB only in the store (trie/) and the tests
# and benches; gRPC and protobuf only where the proto layer is allowed.
EXTERNAL = [
    ("rocksdb/", "rocksdb", {"trie", "tests", "bench"}),
    ("grpcpp/", "grpc", {"server", "client", "tests", "bench"}),
    ("grpc/", "grpc", {"server", "client", "tests", "bench"}),
    ("google/protobuf/", "protobuf", {"server", "client", "tests", "bench"}),
]
SOURCE_EXT = (".h", ".hh", ".hpp", ".cc", ".cpp", ".cxx", ".inc")
SKIP_DIRS = {"node_modules", "build", ".git", "__pycache__"}
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]')

# The codec's inner layers, lowest first: a module may include modules of its own layer and of
# the layers before it. A module is a file name without its extension (codec/envelope.h and
# codec/envelope.cc are module "envelope"), wherever under codec/ the file lies; CODEC_PARTS
# names the files that are part of another module. Derived from the includes (issue 31):
#   base: byte order, checksums, deterministic math, geometry, rotations, codebooks, pools, dumps;
#   entropy: the rANS coders;   format: the envelope every block shares (envelope.h), and the
#   shifted reference's params prefix it parses;   learned: the learned predictor state;
#   kernels: the arithmetic and layouts the coders share;   coders: one encoding's encoder and
#   decoder each;   dispatch: block_codec (EncodeBlock, DecodeBlock);   chain: what runs blocks
#   through the dispatch or checks them (chains, batches, a block alone, an encoded Put's check).
CODEC_LAYERS = [
    ("base", ["little_endian", "crc32c", "det_math", "block_geometry", "rotation", "lloyd_max",
              "thread_pool", "task_pool", "kv_layout", "kv_dump"]),
    ("entropy", ["rans", "rans_interleaved"]),
    ("format", ["reference_shift", "envelope"]),
    ("learned", ["predictor_state"]),
    ("kernels", ["residual_kernels", "residual_search", "fast_residual_kernels",
                 "fast_residual_format"]),
    ("coders", ["lossless", "centroid_lossless", "fast_lossless", "fast_lossless_learned",
                "residual_codec", "baselines", "fast_residual"]),
    ("dispatch", ["block_codec"]),
    ("chain", ["decode_chain", "decode_alone", "block_batch", "block_verify"]),
]
CODEC_PARTS = {
    "predictor_state_internal": "predictor_state",
    "predictor_learner": "predictor_state",
    "predictor_linear_fit": "predictor_state",
    "fast_residual_decode": "fast_residual",
}


def layer_of_include(path):
    for prefix, layer in INCLUDE_LAYER:
        if path.startswith(prefix):
            return layer
    return None


def source_files(top):
    """Yields every C/C++ source under `top`, sorted, skipping SKIP_DIRS."""
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(SOURCE_EXT):
                yield os.path.join(dirpath, name)


def includes_of(file):
    """Yields (line number, included path) of every #include line of `file`."""
    with open(file, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            m = INCLUDE_RE.match(line)
            if m:
                yield lineno, m.group(2)


def check(root):
    """Returns a list of violation strings for the tree at `root`."""
    return check_folders(root) + check_codec(root, CODEC_LAYERS, CODEC_PARTS)


def check_folders(root):
    """The top-level layers (ALLOWED, EXTERNAL): violation strings for the tree at `root`."""
    violations = []
    for layer in sorted(ALLOWED):
        top = os.path.join(root, layer)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in sorted(filenames):
                if not name.endswith(SOURCE_EXT):
                    continue
                file = os.path.join(dirpath, name)
                rel = os.path.relpath(file, root)
                with open(file, encoding="utf-8", errors="replace") as f:
                    for lineno, line in enumerate(f, 1):
                        m = INCLUDE_RE.match(line)
                        if not m:
                            continue
                        inc = m.group(2)
                        target = layer_of_include(inc)
                        if target is not None and target not in ALLOWED[layer]:
                            violations.append(
                                f"{rel}:{lineno}: includes {inc} ({target}); {layer}/ may "
                                f"include only {', '.join(sorted(ALLOWED[layer]))}")
                        for prefix, lib, users in EXTERNAL:
                            if inc.startswith(prefix) and layer not in users:
                                violations.append(
                                    f"{rel}:{lineno}: includes {inc} ({lib}); only "
                                    f"{', '.join(sorted(users))} may use {lib}")
    return violations


def module_of(path, parts):
    """The codec module of a path (a file or an #include of one): its name without extension."""
    stem = os.path.splitext(os.path.basename(path))[0]
    return parts.get(stem, stem)


def is_codec_test(rel):
    """Tests, test helpers and fuzzers: above every codec layer (rel: path under codec/)."""
    name = os.path.basename(rel)
    return (name.endswith("_test.cc") or name.startswith("testing_") or
            rel.split(os.sep)[0] == "fuzz")


def codec_graph(root, layers, parts):
    """Reads codec/: returns (files, edges, unplaced, layer_of).

    files: {module: [relative paths]} of library files; edges: [(file rel, line, included path,
    from module, to module)] between two library modules; unplaced: library files whose module is
    in no layer; layer_of: {module: layer index}; test files and their includes are in `tests`:
    [(file rel, line, included path)] of includes that reach a test helper from a library file.
    """
    layer_of = {}
    for i, (_, modules) in enumerate(layers):
        for m in modules:
            layer_of[m] = i
    files, edges, unplaced, to_tests = {}, [], [], []
    top = os.path.join(root, "codec")
    for file in source_files(top):
        rel = os.path.relpath(file, root)
        if is_codec_test(os.path.relpath(file, top)):
            continue
        src = module_of(file, parts)
        files.setdefault(src, []).append(rel)
        if src not in layer_of:
            unplaced.append(rel)
        for lineno, inc in includes_of(file):
            if not inc.startswith("codec/"):
                continue
            if is_codec_test(inc[len("codec/"):]):
                to_tests.append((rel, lineno, inc))
                continue
            dst = module_of(inc, parts)
            if dst != src:
                edges.append((rel, lineno, inc, src, dst))
    return files, edges, unplaced, layer_of, to_tests


def codec_cycles(edges):
    """Strongly connected components of more than one module, each sorted, in sorted order."""
    graph = {}
    for _, _, _, src, dst in edges:
        graph.setdefault(src, set()).add(dst)
        graph.setdefault(dst, set())
    index, low, on_stack, stack, sccs = {}, {}, set(), [], []

    def visit(v):  # Tarjan; the codec has ~50 modules, so recursion depth is no concern
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(sccs), graph


def cycle_path(scc, graph):
    """One cycle through scc[0] inside the component, as "a -> b -> a" (shortest, BFS)."""
    members, start = set(scc), scc[0]
    prev, queue = {start: None}, [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return " -> ".join([start] + list(reversed(path))[1:] + [start]) if len(
                    path) > 1 else f"{start} -> {start}"
            if w in members and w not in prev:
                prev[w] = v
                queue.append(w)
    return start


def check_codec(root, layers, parts):
    """The codec's inner layers: violation strings for codec/ of the tree at `root`."""
    violations = []
    seen = {}
    for name, modules in layers:
        for m in modules:
            if m in seen:
                violations.append(f"CODEC_LAYERS: module {m} is in layers {seen[m]} and {name}")
            seen[m] = name
    for part, owner in sorted(parts.items()):
        if owner not in seen:
            violations.append(f"CODEC_PARTS: {part} is part of {owner}, which is in no layer")
    if not os.path.isdir(os.path.join(root, "codec")):
        return violations
    files, edges, unplaced, layer_of, to_tests = codec_graph(root, layers, parts)
    for rel in unplaced:
        violations.append(f"{rel}: module {module_of(rel, parts)} is in no codec layer; add it "
                          f"to CODEC_LAYERS (or CODEC_PARTS) in tests/check_layers.py")
    for name, modules in layers:
        for m in modules:
            if m not in files:
                violations.append(f"CODEC_LAYERS: module {m} ({name}) has no file in codec/")
    for rel, lineno, inc, src, dst in edges:
        if src in layer_of and dst in layer_of and layer_of[dst] > layer_of[src]:
            below = [n for n, _ in layers[:layer_of[src] + 1]]
            violations.append(
                f"{rel}:{lineno}: includes {inc} ({layers[layer_of[dst]][0]}); {src} is in "
                f"{layers[layer_of[src]][0]}, which may include only {', '.join(below)}")
    for rel, lineno, inc in to_tests:
        violations.append(f"{rel}:{lineno}: includes {inc}, a test helper; only tests may")
    sccs, graph = codec_cycles(edges)
    for scc in sccs:
        violations.append(f"codec include cycle among {len(scc)} modules ({', '.join(scc)}): "
                          f"{cycle_path(scc, graph)}")
    return violations


def codec_stats(root):
    """Counts for a before/after comparison; the table's stale modules are not counted."""
    files, edges, unplaced, layer_of, _ = codec_graph(root, CODEC_LAYERS, CODEC_PARTS)
    sccs, _ = codec_cycles(edges)
    in_cycles = sorted(m for scc in sccs for m in scc)
    lines = 0
    for m in in_cycles:
        for rel in files.get(m, []):
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                lines += sum(1 for _ in f)
    upward = [e for e in edges
              if e[3] in layer_of and e[4] in layer_of and layer_of[e[4]] > layer_of[e[3]]]
    print(f"codec modules in include cycles: {len(in_cycles)} ({lines} lines) in {len(sccs)} "
          f"cycle(s): {', '.join(in_cycles)}")
    print(f"codec upward includes: {len(upward)}")
    for rel, lineno, inc, src, dst in upward:
        print(f"  {rel}:{lineno}: {src} ({CODEC_LAYERS[layer_of[src]][0]}) -> {inc} "
              f"({CODEC_LAYERS[layer_of[dst]][0]})")
    print(f"codec files in no layer: {len(unplaced)} {' '.join(unplaced)}")
    return 0


def self_test_codec():
    """check_codec must flag each synthetic violation of its own table and nothing else."""
    layers = [("low", ["a", "b"]), ("mid", ["c", "d", "m"]), ("top", ["e", "leaf", "ghost"])]
    parts = {"c_impl": "c", "twin": "nowhere"}
    files = {
        "codec/a.h": '#include "codec/b.h"\n#include <vector>\n',   # same layer, down: fine
        "codec/a.cc": '#include "codec/a.h"\n#include "codec/testing_x.h"\n',  # a test helper
        "codec/b.h": '#include "codec/leaf.h"\n',                   # low -> top: upward
        "codec/leaf.h": '#include <string>\n',
        "codec/c.h": '#include "codec/d.h"\n',                      # c -> d -> c: a cycle
        "codec/c_impl.cc": '#include "codec/c.h"\n#include "codec/a.h"\n',  # part of c: fine
        "codec/d.h": '#include "codec/sub/c.h"\n',                  # a module anywhere in codec/
        "codec/m.h": '#include "codec/c_impl.h"\n',                 # into c, downward: fine
        "codec/sub/e.cc": '#include "codec/c.h"\n',                 # top -> mid: fine
        "codec/stray.h": '#include "codec/a.h"\n',                  # in no layer
        "codec/e_test.cc": '#include "codec/e.h"\n#include "codec/testing_x.h"\n',
        "codec/testing_x.h": '#include "codec/e.h"\n#include "codec/stray.h"\n',
        "codec/fuzz/f.cc": '#include "codec/block_codec.h"\n',
        "codec/README.md": '#include "codec/e.h"\n',               # not a source file
    }
    expected = {
        "CODEC_LAYERS: module ghost (top) has no file in codec/",
        "CODEC_PARTS: twin is part of nowhere, which is in no layer",
        "codec/a.cc:2", "codec/b.h:1", "codec/stray.h",
        "codec include cycle among 2 modules (c, d)",
    }
    dup = check_codec("/nonexistent", [("x", ["a"]), ("y", ["a"])], {})
    with tempfile.TemporaryDirectory() as root:
        for rel, text in files.items():
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        found = set()
        for v in check_codec(root, layers, parts):
            if v.startswith("codec/"):
                found.add(v.split(": ", 1)[0])  # file[:line]
            elif v.startswith("codec include cycle"):
                found.add(v.split(":", 1)[0])  # which modules
            else:
                found.add(v)
    ok = True
    if found != expected:
        print("check_layers codec self-test FAILED: flagged", sorted(found), "expected",
              sorted(expected))
        ok = False
    if dup != ["CODEC_LAYERS: module a is in layers x and y"]:
        print("check_layers codec self-test FAILED: a module in two layers gave", dup)
        ok = False
    return ok


def self_test():
    """The checker must flag each synthetic violation and nothing in the clean files."""
    files = {
        "codec/ok.h": '#include "codec/a.h"\n#include <vector>\n#include "absl/status/status.h"\n',
        "codec/up.cc": '#include "client/kv_dump.h"\n',            # codec -> client
        "trie/up.h": '  #  include "server/x.h"\n',                 # trie -> server
        "trie/proto.cc": '#include "kvtrie/v1/kvtrie.pb.h"\n',     # trie -> proto
        "client/worker/w.cc": '#include "trie/kv_store.h"\n',      # client -> trie
        "client/python/m.cc": '#include "codec/kv_dump.h"\n',      # allowed
        "server/s.cc": '#include "trie/kv_store.h"\n#include "kvtrie/v1/kvtrie.grpc.pb.h"\n',
        "server/db.cc": '#include <rocksdb/db.h>\n',                # RocksDB outside trie/
        "codec/g.cc": '#include <grpcpp/grpcpp.h>\n',              # gRPC in codec
        "tests/t.cc": '#include "server/x.h"\n#include "rocksdb/env.h"\n',
    }
    expected = {"codec/up.cc:1", "trie/up.h:1", "trie/proto.cc:1", "client/worker/w.cc:1",
                "server/db.cc:1", "codec/g.cc:1"}
    with tempfile.TemporaryDirectory() as root:
        for rel, text in files.items():
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        found = {v.split(": ", 1)[0] for v in check_folders(root)}
    if found != expected:
        print("check_layers self-test FAILED: flagged", sorted(found), "expected",
              sorted(expected))
        return False
    return True


def main():
    args = sys.argv[1:]
    stats = bool(args) and args[0] == "--codec-stats"
    if stats:
        args = args[1:]
    root = args[0] if args else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if stats:
        return codec_stats(root)
    if not self_test() or not self_test_codec():
        return 1
    violations = check(root)
    for v in violations:
        print(v)
    if violations:
        print(f"{len(violations)} include(s) point up the layers")
        return 1
    print("include graph OK: no upward arrow; the codec's inner layers have no upward include and "
          "no cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
