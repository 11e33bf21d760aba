"""Extracts vLLM's KV connector interface (KVConnectorBase_V1 in
vllm/distributed/kv_transfer/kv_connector/v1/base.py) as data, with `ast` (nothing is imported
or copied: names, parameters, decorators and annotations as strings), for
test_vllm_conformance.py and the fake vllm package in fake_vllm/.

Regenerate from a vLLM checkout (any Python >= 3.9; vLLM need not be installable):

    git clone https://github.com/vllm-project/vllm /tmp/vllm && git -C /tmp/vllm checkout <commit>
    /usr/bin/python3 tests/python/extract_vllm_api.py /tmp/vllm \\
        > tests/python/data/vllm_kv_connector_v1.json

The commit is `git rev-parse HEAD` of the checkout, or --commit when it is not a git checkout.
Besides KVConnectorBase_V1 it extracts, under "interfaces", the other classes of base.py a
connector meets: SupportsHMA (the hybrid allocator's `request_finished_all_groups`),
KVConnectorWorkerMetadata (worker -> scheduler metadata, `aggregate`),
KVConnectorHandshakeMetadata and KVConnectorMetadata (bases and methods), and the module-level
`supports_hma` function. vLLM's metrics.py (KVConnectorStats, KVConnectorPromMetrics) and
factory.py (KVConnectorFactory) are extracted when --with-metrics-and-factory is given (they
were not readable at the pinned commit through the source index, so the committed JSON has
none).
The committed JSON (vLLM 003df2961dd8830c317a61f9745ccd557da9fa06) was made with --commit from a
signatures-only transcription of that commit's base.py, read through a source index (the whole
vLLM snapshot, 1.1 GB, could not be fetched here); regenerating it from a real checkout of that
commit must give the same file.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
METRICS = "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py"
FACTORY = "vllm/distributed/kv_transfer/kv_connector/factory.py"
CLASS = "KVConnectorBase_V1"
INTERFACES = ("SupportsHMA", "KVConnectorWorkerMetadata", "KVConnectorHandshakeMetadata",
              "KVConnectorMetadata")
FUNCTIONS = ("supports_hma",)
DECORATORS = ("abstractmethod", "staticmethod", "classmethod", "property")


def _decorator_name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ast.unparse(node)


def _param(arg: ast.arg, kind: str, default) -> dict:
    return {"name": arg.arg, "kind": kind,
            "annotation": ast.unparse(arg.annotation) if arg.annotation else None,
            "default": ast.unparse(default) if default is not None else None,
            "has_default": default is not None}


def parameters(fn: ast.FunctionDef) -> list:
    """The parameters in order, with inspect.Parameter's kind names."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = []
    for i, arg in enumerate(positional):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append(_param(arg, kind, defaults[i]))
    if a.vararg:
        out.append(_param(a.vararg, "VAR_POSITIONAL", None))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append(_param(arg, "KEYWORD_ONLY", default))
    if a.kwarg:
        out.append(_param(a.kwarg, "VAR_KEYWORD", None))
    return out


def method(fn: ast.FunctionDef) -> dict:
    decorators = [_decorator_name(d) for d in fn.decorator_list]
    kind = "method"
    for d in ("staticmethod", "classmethod", "property"):
        if d in decorators:
            kind = d
    return {"name": fn.name, "kind": kind, "abstract": "abstractmethod" in decorators,
            "async": isinstance(fn, ast.AsyncFunctionDef),
            "decorators": [d for d in decorators if d not in DECORATORS],
            "parameters": parameters(fn),
            "returns": ast.unparse(fn.returns) if fn.returns else None}


def interface(node: ast.ClassDef) -> dict:
    """A class's bases and its methods (as `method`)."""
    return {"bases": [ast.unparse(b) for b in node.bases],
            "methods": [method(n) for n in node.body
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]}


def extract_classes(source: str, names) -> dict:
    """`interface` of each class of `source` named in `names` (those present)."""
    tree = ast.parse(source)
    return {n.name: interface(n) for n in tree.body
            if isinstance(n, ast.ClassDef) and n.name in names}


def extract(source: str) -> dict:
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    base = classes[CLASS]
    methods = [method(n) for n in base.body
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    role = classes["KVConnectorRole"]
    members = {t.targets[0].id: ast.literal_eval(t.value) for t in role.body
               if isinstance(t, ast.Assign) and isinstance(t.targets[0], ast.Name)}
    return {
        "class": CLASS,
        "bases": [ast.unparse(b) for b in base.bases],
        "constructor": next(m for m in methods if m["name"] == "__init__"),
        "methods": [m for m in methods if m["name"] != "__init__"],
        "KVConnectorRole": {"bases": [ast.unparse(b) for b in role.bases], "members": members},
        "KVConnectorMetadata": {
            "bases": [ast.unparse(b) for b in classes["KVConnectorMetadata"].bases]},
        "interfaces": extract_classes(source, INTERFACES),
        "functions": [method(n) for n in tree.body
                      if isinstance(n, ast.FunctionDef) and n.name in FUNCTIONS],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("vllm_root", type=Path, help="a vLLM checkout (its top directory)")
    p.add_argument("--commit", help="the checkout's commit (default: git rev-parse HEAD)")
    p.add_argument("--with-metrics-and-factory", action="store_true",
                   help=f"also extract {METRICS} and {FACTORY}")
    args = p.parse_args()
    commit = args.commit or subprocess.check_output(
        ["git", "-C", str(args.vllm_root), "rev-parse", "HEAD"], text=True).strip()
    api = extract((args.vllm_root / BASE).read_text())
    if args.with_metrics_and_factory:
        api["interfaces"].update(extract_classes(
            (args.vllm_root / METRICS).read_text(), ("KVConnectorStats", "KVConnectorPromMetrics")))
        api["interfaces"].update(extract_classes(
            (args.vllm_root / FACTORY).read_text(), ("KVConnectorFactory",)))
    doc = {"vllm_repository": "https://github.com/vllm-project/vllm", "vllm_commit": commit,
           "source": BASE,
           "generated_by": "tests/python/extract_vllm_api.py <vllm checkout> (see its docstring)",
           **api}
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
