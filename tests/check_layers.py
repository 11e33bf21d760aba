#!/usr/bin/python3
"""Checks the include graph: layers point one way (server -> trie -> codec, client -> codec;
only server and client, and the tests and benches above them, use the generated proto code).

Reads every `#include "..."` and `#include <...>` line of every C/C++ source under the layer
folders below, maps the included path to a layer by its first component, and fails (exit 1,
one line per violation: file:line: what it includes and what the layer may include) when a file
includes a layer that its own layer's rule does not allow. Paths that are no layer (the standard
library, absl, gtest, ...) are not checked, except the external libraries in EXTERNAL.

Before checking the repository it checks itself on a synthetic tree with known violations, so a
rule table or parser that stops matching anything fails the test too.

Usage: tests/check_layers.py [REPO_ROOT]   (default: the folder above this script)
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


def layer_of_include(path):
    for prefix, layer in INCLUDE_LAYER:
        if path.startswith(prefix):
            return layer
    return None


def check(root):
    """Returns a list of violation strings for the tree at `root`."""
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
        found = {v.split(": ", 1)[0] for v in check(root)}
    if found != expected:
        print("check_layers self-test FAILED: flagged", sorted(found), "expected",
              sorted(expected))
        return False
    return True


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))
    if not self_test():
        return 1
    violations = check(root)
    for v in violations:
        print(v)
    if violations:
        print(f"{len(violations)} include(s) point up the layers")
        return 1
    print("include graph OK: no upward arrow")
    return 0


if __name__ == "__main__":
    sys.exit(main())
