"""kvtrie.Error's machine-readable reason (issue 31): the server names the errors a caller acts on
by a google.rpc.ErrorInfo reason in the status details (client/status_reason.h); the package
raises them with ``.reason`` and ``.stale_predictor_version``, so callers match on those, never on
the message text. Errors without a reason (from a real server through the C++ extension, from
the shard binding, from Python's own checks) carry ``reason == ""``.

The stale-version refusal itself is provoked against a real server in
tests/client_encode_e2e_test.cc (it needs a learned state freed under a client that cached it);
the C++ client answers it by encoding again, so Python sees it only if that fails too."""

from __future__ import annotations

import numpy as np
import pytest

import kvtrie
from kvtrie import _kvtrie
from kvtrie._errors import from_status


def test_the_stale_reason_is_an_attribute_not_text():
    e = from_status(kvtrie.StatusCode.FAILED_PRECONDITION,
                    "block 3 encoded: version 1 is not kept", kvtrie.STALE_PREDICTOR_VERSION)
    assert isinstance(e, kvtrie.Error)
    assert e.code == kvtrie.StatusCode.FAILED_PRECONDITION
    assert e.reason == "STALE_PREDICTOR_VERSION" == kvtrie.STALE_PREDICTOR_VERSION
    assert e.stale_predictor_version
    # The text alone says nothing: a message naming predictor_version without the reason is not
    # a stale version, nor is the reason under another code.
    text_only = from_status(kvtrie.StatusCode.FAILED_PRECONDITION,
                            "predictor_version: version 1 is not kept")
    assert text_only.reason == "" and not text_only.stale_predictor_version
    other_code = from_status(kvtrie.StatusCode.INVALID_ARGUMENT, "x: bad",
                             kvtrie.STALE_PREDICTOR_VERSION)
    assert isinstance(other_code, kvtrie.InvalidArgumentError)
    assert other_code.reason == kvtrie.STALE_PREDICTOR_VERSION
    assert not other_code.stale_predictor_version
    with pytest.raises(kvtrie.Error) as raised:
        raise e
    assert raised.value.stale_predictor_version


def test_a_real_servers_error_has_no_reason(server):
    c = kvtrie.Client(server.target, "stories260K", namespace="py-errors")
    with pytest.raises(kvtrie.NotFoundError) as raised:
        c.delete(np.arange(16, dtype=np.uint32))  # nothing stored
    assert raised.value.code == kvtrie.StatusCode.NOT_FOUND
    assert raised.value.reason == ""
    assert not raised.value.stale_predictor_version


def test_the_shard_bindings_errors_have_no_reason():
    with pytest.raises(kvtrie.Error) as raised:
        _kvtrie._parse_shards("no-equals-sign")
    assert raised.value.reason == ""
    assert not raised.value.stale_predictor_version


def test_pythons_own_checks_have_no_reason():
    with pytest.raises(kvtrie.InvalidArgumentError) as raised:
        kvtrie.ShardedClient("stories260K")  # neither shards nor shards_dns
    assert raised.value.reason == "" and not raised.value.stale_predictor_version
