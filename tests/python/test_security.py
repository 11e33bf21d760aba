"""kvtrie.Client's tls= and token= against a real kvtrie-server run with TLS, mTLS and tokens.

Certificates are made at test time with /usr/bin/openssl (P-256, as tests/ops_e2e_test.cc); the
server runs with --tls_cert/--tls_key, --tls_client_ca/--tls_require_client_cert, --tokens_file.
"""

from __future__ import annotations

import gc
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

import kvtrie
from conftest import SERVER, TESTDATA, ServerProcess, read_dump

SESSION = TESTDATA / "sessions" / "s0"
OPENSSL = "/usr/bin/openssl"


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def openssl(*args: str) -> None:
    r = subprocess.run([OPENSSL, *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def make_ca(d: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.pem"), "-days", "2",
            "-subj", f"/CN={name}")


def make_cert(d: Path, ca: str, name: str) -> None:
    """A certificate signed by `ca` for localhost and 127.0.0.1."""
    p = d / name
    (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{p}.key", "-out", f"{p}.csr", "-subj", f"/CN={name}")
    openssl("x509", "-req", "-in", f"{p}.csr", "-CA", str(d / f"{ca}.pem"), "-CAkey",
            str(d / f"{ca}.key"), "-CAcreateserial", "-out", f"{p}.pem", "-days", "2",
            "-extfile", str(d / f"{name}.ext"))


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    if not Path(OPENSSL).exists():
        pytest.fail(f"{OPENSSL} is missing (Debian package openssl)")
    d = tmp_path_factory.mktemp("certs")
    make_ca(d, "ca")
    make_cert(d, "ca", "server")
    make_cert(d, "ca", "client")
    make_ca(d, "rogue")
    make_cert(d, "rogue", "intruder")
    return d


@pytest.fixture
def start(tmp_path):
    if not SERVER.exists():
        pytest.fail(f"{SERVER} is missing: build it (deploy/build.sh kvtrie-server)")
    servers = []

    def run(*flags: str) -> ServerProcess:
        s = ServerProcess(tmp_path / f"data{len(servers)}", flags)
        servers.append(s)
        return s

    yield run
    gc.collect()  # the test's clients close their channels, so the servers stop at once
    for s in servers:
        assert s.stop() == 0, s.log_path.read_text(errors="replace")


def tls_flags(d: Path):
    return (f"--tls_cert={d / 'server.pem'}", f"--tls_key={d / 'server.key'}")


def refused(client: kvtrie.Client, code: kvtrie.StatusCode) -> kvtrie.Error:
    with pytest.raises(kvtrie.Error) as e:
        client.lookup(list(range(32)))
    assert e.value.code == code, e.value
    return e.value


def round_trip_bit_exact(c: kvtrie.Client) -> None:
    tokens, surprisal, k, v = read_dump(SESSION)
    r = c.put(tokens, k, v, surprisal=surprisal, encoding="lossless")
    assert (r.stored_tokens, r.blocks_stored) == (512, 32)
    assert c.lookup(tokens) == 512
    for mode in ("reconstructed", "residual"):
        k2, v2, n = c.get(tokens, mode=mode)
        assert n == 512 and k2.dtype == k.dtype and k2.shape == k.shape
        assert np.array_equal(bits(k2), bits(k)) and np.array_equal(bits(v2), bits(v))


def test_tls_client_with_the_ca_round_trips_a_session_and_plaintext_is_refused(certs, start):
    s = start(*tls_flags(certs))
    c = kvtrie.Client(s.target, "stories260K", tls=kvtrie.TlsConfig(ca=certs / "ca.pem"),
                      timeout=10, namespace="tls")
    assert c.tls
    round_trip_bit_exact(c)
    # The mapping form, with the name checked in the certificate given explicitly.
    m = kvtrie.Client(s.target, "stories260K", tls={"ca": str(certs / "ca.pem"),
                                                      "server_name": "localhost"},
                      namespace="tls")
    assert m.lookup(read_dump(SESSION)[0]) == 512
    # Refused: plaintext, a CA that did not sign the server's certificate, the system's roots,
    # and a name the certificate does not carry.
    refused(kvtrie.Client(s.target, "stories260K", timeout=5), kvtrie.StatusCode.UNAVAILABLE)
    refused(kvtrie.Client(s.target, "stories260K", tls={"ca": certs / "rogue.pem"}, timeout=5),
            kvtrie.StatusCode.UNAVAILABLE)
    refused(kvtrie.Client(s.target, "stories260K", tls=True, timeout=5),
            kvtrie.StatusCode.UNAVAILABLE)
    refused(kvtrie.Client(s.target, "stories260K", timeout=5,
                          tls=kvtrie.TlsConfig(ca=certs / "ca.pem", server_name="elsewhere")),
            kvtrie.StatusCode.UNAVAILABLE)
    # ... and a TLS client is refused by a plaintext server.
    plain = start()
    refused(kvtrie.Client(plain.target, "stories260K", tls={"ca": certs / "ca.pem"}, timeout=5),
            kvtrie.StatusCode.UNAVAILABLE)


def test_mutual_tls_refuses_a_client_without_a_valid_certificate(certs, start):
    s = start(*tls_flags(certs), f"--tls_client_ca={certs / 'ca.pem'}",
              "--tls_require_client_cert")
    ca = certs / "ca.pem"
    refused(kvtrie.Client(s.target, "stories260K", tls=kvtrie.TlsConfig(ca=ca), timeout=5),
            kvtrie.StatusCode.UNAVAILABLE)
    refused(kvtrie.Client(s.target, "stories260K", timeout=5,
                          tls=kvtrie.TlsConfig(ca=ca, cert=certs / "intruder.pem",
                                               key=certs / "intruder.key")),
            kvtrie.StatusCode.UNAVAILABLE)
    refused(kvtrie.Client(s.target, "stories260K", timeout=5), kvtrie.StatusCode.UNAVAILABLE)
    c = kvtrie.Client(s.target, "stories260K", timeout=10, namespace="mtls",
                      tls=kvtrie.TlsConfig(ca=ca, cert=certs / "client.pem",
                                           key=certs / "client.key"))
    round_trip_bit_exact(c)


def test_tokens_right_one_works_wrong_or_missing_is_unauthenticated(certs, start, tmp_path):
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps({"tenants": [
        {"name": "team-a", "tokens": ["s3cret-a"], "namespaces": ["team-a"]},
        {"name": "team-b", "tokens": ["s3cret-b"], "namespaces": ["team-b"]}]}))
    # Over TLS, as tokens should travel.
    s = start(*tls_flags(certs), f"--tokens_file={tokens_file}")
    tls = kvtrie.TlsConfig(ca=certs / "ca.pem")
    a = kvtrie.Client(s.target, "stories260K", token="s3cret-a", tls=tls, timeout=10)
    round_trip_bit_exact(a)  # namespace "" is team-a's default
    tokens = read_dump(SESSION)[0]
    e = refused(kvtrie.Client(s.target, "stories260K", token="s3cret-x", tls=tls, timeout=5),
                kvtrie.StatusCode.UNAUTHENTICATED)
    assert e.field == "authorization" and "unknown token" in e.message
    e = refused(kvtrie.Client(s.target, "stories260K", tls=tls, timeout=5),
                kvtrie.StatusCode.UNAUTHENTICATED)
    assert e.field == "authorization"
    # Team b's token sees its own (empty) namespace, and may not name team-a's.
    b = kvtrie.Client(s.target, "stories260K", token="s3cret-b", tls=tls, timeout=5)
    assert b.lookup(tokens) == 0
    e = refused(kvtrie.Client(s.target, "stories260K", token="s3cret-b", tls=tls, timeout=5,
                              namespace="team-a"), kvtrie.StatusCode.PERMISSION_DENIED)
    assert e.field == "namespace"
    assert a.lookup(tokens) == 512


def test_bad_tls_settings_raise_invalid_argument_naming_the_field(certs, tmp_path):
    target = "127.0.0.1:1"  # never contacted: the settings are checked when the Client is made
    cases = [
        ({"ca": tmp_path / "missing.pem"}, "tls.ca"),
        ({"ca": certs / "server.ext"}, "tls.ca"),  # not PEM
        ({"ca": certs / "ca.pem", "cert": certs / "client.pem"}, "tls.key"),
        (kvtrie.TlsConfig(key=certs / "client.key"), "tls.cert"),
        ({"ca": certs / "ca.pem", "certificate": certs / "client.pem"}, "tls.certificate"),
        ("ca.pem", "tls"),
    ]
    for tls, field in cases:
        with pytest.raises(kvtrie.InvalidArgumentError) as e:
            kvtrie.Client(target, "stories260K", tls=tls)
        assert e.value.field == field, (tls, e.value)
