"""vLLM's LLM(...) on the CPU with the OffloadingConnector backed by kv_ops (run by test_vllm.py).

Makes a tiny random model in argv[1] (argv[2]: "llama", the default, or "mla", a DeepSeek-V2
with its compressed latent KV cache), generates greedily from a 128-token prompt (four blocks;
eight at MLA's block size 16), drops vLLM's prefix cache, and generates again: the second
run's prefix comes back through OffloadOpsWorker.submit_load; then zeroes the worker's host
copy and generates a third time. Prints one JSON line: the token lists and the worker's calls.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of CPU "GPU" cache
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process

import torch  # noqa: E402
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

import kv_ops.integrations.vllm as kv_vllm  # noqa: E402

calls = {"workers": 0, "stores": 0, "loads": 0}
workers = []
_init, _store, _load = (
    kv_vllm.OffloadOpsWorker.__init__,
    kv_vllm.OffloadOpsWorker.submit_store,
    kv_vllm.OffloadOpsWorker.submit_load,
)


def _counted(fn, key):
    def wrapper(self, *args, **kwargs):
        calls[key] += 1
        return fn(self, *args, **kwargs)

    return wrapper


def _init_kept(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    workers.append(self)


kv_vllm.OffloadOpsWorker.__init__ = _counted(_init_kept, "workers")
kv_vllm.OffloadOpsWorker.submit_store = _counted(_store, "stores")
kv_vllm.OffloadOpsWorker.submit_load = _counted(_load, "loads")

model_dir = sys.argv[1]
torch.manual_seed(0)
kind = sys.argv[2] if len(sys.argv) > 2 else "llama"
common = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
if kind == "llama":
    # head_dim 64: the CPU attention backend refuses 16
    model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **common))
elif kind == "mla":
    # The CPU MLA decode kernel only takes a latent of kv_lora_rank 512 + rope 64.
    config = DeepseekV2Config(
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        q_lora_rank=None,
        first_k_dense_replace=2,  # no MoE layers
        rope_scaling=None,
        **common,
    )
    model = DeepseekV2ForCausalLM(config)
else:
    raise SystemExit(f"unknown model kind {kind!r}")
model.save_pretrained(model_dir)

llm = LLM(
    model=model_dir,
    skip_tokenizer_init=True,
    dtype="float32",
    max_model_len=256,
    enforce_eager=True,
    # MLA: pin the reference CPU_MLA backend (AMX_MLA, picked where AMX is, wants 16-bit
    # weights); vLLM then forces block_size 16 and turns its own prefix caching off, so
    # the second run's prefix can only come back through the connector.
    attention_config={"backend": "CPU_MLA"} if kind == "mla" else None,
    block_size=32,  # the CPU attention backend wants multiples of 32
    max_num_seqs=4,
    enable_prefix_caching=True,
    kv_transfer_config=KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "OffloadOpsSpec",
            "spec_module_path": "kv_ops.integrations.vllm",
            "cpu_bytes_to_use": 64 << 20,
        },
    ),
)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
prompt = {"prompt_token_ids": list(range(3, 131))}  # 128 tokens: four blocks
first = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
llm.reset_prefix_cache()
second = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
loads = calls["loads"]
# Control: zero the host copy and load again; the tokens must change, so the second run's
# tokens came from the bytes the worker loaded.
workers[0].engine.mirror.zero_()
llm.reset_prefix_cache()
zeroed = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
result = {"first": first, "second": second, "zeroed": zeroed, "loads_before_control": loads, **calls}
print("RESULT " + json.dumps(result), flush=True)
