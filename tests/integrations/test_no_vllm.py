"""`import kv_ops` (and kv_ops.integrations) never needs vLLM; the vLLM adapter says what it needs."""

import subprocess
import sys

CODE = """
import sys
sys.modules["vllm"] = None  # any import of vllm now raises ImportError
import kv_ops, kv_ops.integrations
assert kv_ops.integrations.VLLM_VERSION == "0.32.0"
assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules if sys.modules[m] is not None)
"""


def test_kv_ops_imports_without_vllm():
    subprocess.run([sys.executable, "-c", CODE], check=True, timeout=300)
