"""Adapters that plug :class:`kv_ops.OffloadEngine` into inference engines.

Each adapter is its own module and imports its engine only when that module is imported:
``import kv_ops`` and ``import kv_ops.integrations`` never need vLLM.

- :mod:`kv_ops.integrations.vllm`: ``OffloadOpsSpec``, an out-of-tree spec for vLLM's
  ``OffloadingConnector`` (tested against vLLM ``VLLM_VERSION``).
"""

VLLM_VERSION = "0.32.0"  # the vLLM release kv_ops.integrations.vllm is tested against

__all__ = ["VLLM_VERSION"]
