"""`pip install ./client/python` into a venv builds the extension for the venv's interpreter
(client/python/setup.py: CMake with -DPython3_EXECUTABLE=<venv python>, into
build-py-<SOABI>), and the installed package (not the build tree's) imports there and talks to a
real kvtrie-server. The venv is made from Debian's python3 (3.11, the only Python here) with
--system-site-packages (numpy, setuptools), and pip runs with --no-build-isolation --no-index:
no network. The build reuses ccache (build-py-* sits beside build/, so its objects hit): about
15 s here after build/ is built; ctest runs it as python_install (label `install`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, TESTDATA


def _run(argv, **kwargs) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    assert r.returncode == 0, f"{argv} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def test_pip_install_into_a_venv_builds_for_its_python(tmp_path, server):
    try:
        import ensurepip  # noqa: F401 - python3-venv; without it venv has no pip
    except ImportError:
        pytest.skip("python3-venv is not installed (deploy/install_deps.sh installs it)")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], timeout=300)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVTRIE_BUILD_DIR")}
    env.update(KVTRIE_SKIP_DEPS="1", KVTRIE_BUILD_JOBS=os.environ.get("KVTRIE_BUILD_JOBS", "2"),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    _run([str(python), "-m", "pip", "install", "--no-build-isolation", "--no-index",
          str(REPO / "client" / "python")], env=env, cwd=REPO, timeout=1500)
    script = textwrap.dedent(f"""
        import json, sys, sysconfig
        import numpy as np
        import kvtrie, kvtrie.connector
        assert kvtrie.__file__.startswith(sys.prefix), kvtrie.__file__
        assert kvtrie._kvtrie.__file__.endswith(sysconfig.get_config_var("EXT_SUFFIX"))
        d = {str(TESTDATA / "sessions" / "s0")!r} + "/"
        tokens = json.load(open(d + "manifest.json"))["token_ids"]
        k, v = np.load(d + "k.npy"), np.load(d + "v.npy")
        c = kvtrie.Client({server.target!r}, "install-test")
        c.put(tokens, k, v, encoding="lossless")
        assert c.lookup(tokens) == len(tokens)
        gk, gv, n = c.get(tokens)
        assert n == len(tokens) and np.array_equal(gk, k) and np.array_equal(gv, v)
        print(sys.prefix, sys.version_info[:2], kvtrie._kvtrie.__file__, n)
    """)
    r = _run([str(python), "-c", script], env=env, cwd=tmp_path, timeout=120)
    prefix, *_ = r.stdout.split()
    assert Path(prefix) == venv, r.stdout
    assert str(venv) in r.stdout and "_kvtrie" in r.stdout


def test_package_sources_parse_as_python_3_9():
    """Only Python 3.11 is here: at least the grammar of every installed file is 3.9's (no
    `match`, no parenthesized context managers; annotations are strings by `from __future__
    import annotations`, which each module must have)."""
    import ast
    package = REPO / "client" / "python"
    files = sorted((package / "kvtrie").glob("*.py")) + [package / "setup.py"]
    assert len(files) >= 5
    for f in files:
        text = f.read_text()
        ast.parse(text, filename=str(f), feature_version=(3, 9))
        if f.parent.name == "kvtrie":
            assert "from __future__ import annotations" in text, f
