"""Stock transformers Gemma 4, its per-layer embedding table in page-locked host memory.

The run of examples/gemma3n_transformers.py with ``--model gemma4``: ``Gemma4ForCausalLM`` from a
random-weight config at Gemma 4 E2B's text widths on CUDA (a tiny one on the CPU), compiled
``generate()`` with a static cache, stock and after

    model.set_per_layer_input_embeddings(ple_ops.host_embedding(model.get_per_layer_input_embeddings()))

reporting the GPU memory freed against the table's size, the decode tokens/s of both, and
whether the greedy tokens are identical (exit status 1 otherwise). Takes the same flags.

    python examples/gemma4_transformers.py                  # E2B widths on CUDA, a tiny config on the CPU
    python examples/gemma4_transformers.py --config tiny    # anywhere, a minute or two on a CPU
"""

import sys

from gemma3n_transformers import main  # this file's folder is first on sys.path when run as a script

if __name__ == "__main__":
    sys.exit(main(default_model="gemma4"))
