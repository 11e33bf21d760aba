"""Fake vllm (see vllm/__init__.py)."""
