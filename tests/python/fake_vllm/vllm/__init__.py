"""A fake `vllm` for tests (test_vllm_conformance.py): just the modules and classes
kvtrie.connector imports and vLLM's connector factory uses, with KVConnectorBase_V1's signatures
built from tests/python/data/vllm_kv_connector_v1.json (vLLM's base.py at a pinned commit,
extracted as data by tests/python/extract_vllm_api.py). Not vLLM: put this directory
(tests/python/fake_vllm) on sys.path only in tests."""
