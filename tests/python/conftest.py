"""Shared fixtures of the Python tests: a real kvtrie-server process on a loopback port 0.

Run by ctest (tests/CMakeLists.txt) with PYTHONPATH=<build>/client/python and KVTRIE_BUILD_DIR;
by hand: PYTHONPATH=build/client/python /usr/bin/python3 -m pytest tests/python
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("KVTRIE_BUILD_DIR", REPO / "build"))
SERVER = BUILD / "server" / "kvtrie-server"
TESTDATA = REPO / "tests" / "data"


def _model() -> Path:
    """$KVTRIE_MODEL, else the repository's copy (tests/data/stories260K), else the shared one
    ($KVTRIE_SHARED_DATA_DIR, default ../shared/data), as client/worker/test_model.h."""
    if os.environ.get("KVTRIE_MODEL"):
        return Path(os.environ["KVTRIE_MODEL"])
    in_repo = TESTDATA / "stories260K" / "stories260K.gguf"
    if in_repo.exists():
        return in_repo
    shared = os.environ.get("KVTRIE_SHARED_DATA_DIR") or REPO.parent / "shared" / "data"
    return Path(shared) / "stories260K" / "stories260K.gguf"


MODEL = _model()


class ServerProcess:
    """kvtrie-server --listen=127.0.0.1:0 --port_file=... --data_dir=..., as tests/server_process.h."""

    def __init__(self, data_dir: Path, extra_flags=()):
        self.data_dir = Path(data_dir)
        self.port_file = Path(str(data_dir) + ".port")
        self.log_path = Path(str(data_dir) + ".log")
        self.port_file.unlink(missing_ok=True)
        argv = [str(SERVER), "--listen=127.0.0.1:0", f"--data_dir={data_dir}",
                f"--port_file={self.port_file}", "--shutdown_grace_seconds=5", *extra_flags]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtrie-server exited with {self.proc.returncode}:\n"
                                   + self.log_path.read_text(errors="replace"))
            try:
                self.port = int(self.port_file.read_text().strip())
                if self.port > 0:
                    return
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.02)
        self.proc.kill()
        raise RuntimeError("kvtrie-server did not serve within 30 s")

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not SERVER.exists():
        pytest.fail(f"{SERVER} is missing: build it (deploy/build.sh kvtrie-server)")
    s = ServerProcess(tmp_path_factory.mktemp("kvtrie") / "data")
    yield s
    s.stop()


def read_dump(folder: Path):
    """(token_ids uint32, surprisal float32, k, v) of a KV dump folder (tests/data/README.md)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    tokens = np.asarray(manifest["token_ids"], dtype=np.uint32)
    surprisal = np.asarray([0.0 if s is None else s for s in manifest["surprisal_bits"]],
                           dtype=np.float32)
    return tokens, surprisal, np.load(folder / "k.npy"), np.load(folder / "v.npy")
