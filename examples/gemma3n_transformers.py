"""Stock transformers Gemma 3n (or Gemma 4), its per-layer embedding table in page-locked host memory.

Builds ``Gemma3nForCausalLM`` (``--model gemma4``: ``Gemma4ForCausalLM``) from a config with
random weights (nothing is downloaded), runs ``generate()`` with a static cache, compiled the way
transformers documents (``generation_config.compile_config``, ``fullgraph=True``; on CUDA its
default ``mode="reduce-overhead"``, i.e. CUDA graphs), once stock and once after the one line

    model.set_per_layer_input_embeddings(ple_ops.host_embedding(model.get_per_layer_input_embeddings()))

(for both, the same as ``model.model.embed_tokens_per_layer = ple_ops.host_embedding(...)``) and
checks that the greedy tokens are identical (exit status 1 otherwise). It reports the GPU memory
that line frees and the decode tokens/s of both runs.

    python examples/gemma3n_transformers.py                 # E2B widths on CUDA, a tiny config on the CPU
    python examples/gemma3n_transformers.py --config tiny   # anywhere, about a minute or two on a CPU
    python examples/gemma3n_transformers.py --model gemma4  # Gemma 4 E2B's widths, these two runs only

examples/gemma4_transformers.py runs Gemma 4 with a third run: the host table together with
kv_ops's HostOffloadedCache, the full-attention KV cache in page-locked host memory too.

The two models are built from the same seed (so the same weights) and both stay alive: their
timed runs alternate (stock, host, host, stock, ...) and the best of each is compared, since the
host-bound decode step follows the host's speed, which drifts. The memory freed is measured on
the second model, fresh, with no compiled graph holding its old table.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch
import transformers
from packaging.version import Version
from transformers import Gemma3nForCausalLM, Gemma3nTextConfig, GenerationConfig
from transformers.generation import CompileConfig

import ple_ops
from kv_ops.cuda.arguments import device as device_argument

try:  # transformers' Gemma 4; --model gemma4 needs it, Gemma 3n does not
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
except ImportError:
    Gemma4ForCausalLM = Gemma4TextConfig = None


MODELS = ("gemma3n", "gemma4")


def config(name: str, model: str = "gemma3n"):
    """The text config of ``model`` ("gemma3n" or "gemma4") at ``name``'s widths ("tiny" or "e2b")."""
    if model == "gemma4":
        return gemma4_config(name)
    if name == "e2b":  # Gemma 3n E2B's text widths: hidden 2048, 30 layers, PLE 256, vocab 262144
        layers = 30
        return Gemma3nTextConfig(
            # The checkpoint's vocab_size is 262400: the ids above 262144 are the multimodal
            # model's vision and audio tokens, which it masks before the per-layer table. The
            # text-only model indexes that table with every id, so a random-weight greedy
            # decode that picked one (or a prompt drawn from them) hits an out-of-range index in
            # the stock model: the text vocabulary is the table's.
            vocab_size=262_144,
            vocab_size_per_layer_input=262_144,
            hidden_size=2048,
            hidden_size_per_layer_input=256,
            intermediate_size=8192,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            num_kv_shared_layers=10,
            layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(layers)],
            activation_sparsity_pattern=[0.95] * 10 + [0.0] * 20,
            sliding_window=512,
            max_position_embeddings=4096,
        )
    layers = 2  # tiny: what CI runs on the CPU
    return Gemma3nTextConfig(
        vocab_size=512,
        vocab_size_per_layer_input=512,
        hidden_size=64,
        hidden_size_per_layer_input=24,  # embed_scale sqrt(24) is not a power of two: the product rounds
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_kv_shared_layers=0,
        layer_types=["sliding_attention", "full_attention"],
        activation_sparsity_pattern=[0.0] * layers,
        laurel_rank=8,
        sliding_window=16,
        max_position_embeddings=256,
    )


def gemma4_config(name: str):
    if Gemma4TextConfig is None:
        raise SystemExit("gemma4 transformers: this transformers release has no Gemma 4 (models/gemma4)")
    if name == "e2b":  # Gemma 4 E2B's text widths: hidden 1536, 35 layers, PLE 256, vocab 262144
        layers = 35
        return Gemma4TextConfig(
            # Unlike Gemma 3n's checkpoint, Gemma 4's text vocabulary is the per-layer table's:
            # the multimodal tokens lie inside it.
            vocab_size=262_144,
            vocab_size_per_layer_input=262_144,
            hidden_size=1536,
            hidden_size_per_layer_input=256,
            intermediate_size=6144,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=256,
            global_head_dim=512,
            num_kv_shared_layers=20,
            layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(layers)],
            use_double_wide_mlp=True,
            final_logit_softcapping=30.0,
            sliding_window=512,
            max_position_embeddings=4096,
        )
    # tiny: what CI runs on the CPU. The last two layers reuse earlier layers' KV, as E2B's last 20
    # do, and three full-attention layers own a cache, as in E2B: so that a GPU budget of two
    # layers streams (examples/gemma4_transformers.py's HostOffloadedCache run).
    layers = 8
    return Gemma4TextConfig(
        vocab_size=512,
        vocab_size_per_layer_input=512,
        hidden_size=64,
        hidden_size_per_layer_input=24,  # embed_scale sqrt(24) is not a power of two: the product rounds
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 4,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
        sliding_window=16,
        max_position_embeddings=256,
    )


def build(cfg, device: torch.device, dtype: torch.dtype):
    """``cfg``'s causal LM (Gemma 3n or Gemma 4), with the weights of seed 0."""
    cls = Gemma4ForCausalLM if cfg.model_type == "gemma4_text" else Gemma3nForCausalLM
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # built in place: the E2B widths' 10 GB never pass through the CPU
            model = cls(cfg)
    finally:
        torch.set_default_dtype(default)
    # transformers initialises Gemma 3n's AltUp correction scale to zero, which cancels the
    # per-layer inputs: the table would never reach the logits, and comparing them could not
    # catch a wrong row. A checkpoint's scale is not zero; so is this one.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("altup.correct_output_scale"):
                param.normal_()
    return model.eval()


def generation_config(
    new_tokens: int, device: torch.device, backend: str, cache_implementation: str | None = "static"
) -> GenerationConfig:
    """Greedy, exactly ``new_tokens``, compiled; ``cache_implementation=None`` for a cache passed to generate()."""
    compile_config = CompileConfig(
        fullgraph=True, backend=backend, mode="reduce-overhead" if device.type == "cuda" else None
    )
    if device.type != "cuda":
        compile_config._compile_all_devices = True  # transformers auto-compiles only on accelerators otherwise
    return GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        cache_implementation=cache_implementation,
        compile_config=compile_config,
        pad_token_id=0,
        eos_token_id=None,
    )


def timed_generate(model, ids, gen_config) -> tuple[torch.Tensor, float]:
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, generation_config=gen_config)
    sync()
    return out, time.perf_counter() - start


def warm(model, ids, args, device) -> tuple[GenerationConfig, GenerationConfig]:
    """Compile (and on CUDA capture) the decode step of both generate() lengths the timing runs."""
    full = generation_config(args.new_tokens, device, args.backend)
    one = generation_config(1, device, args.backend)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    timed_generate(model, ids, full)
    timed_generate(model, ids, one)
    if torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs:
        raise SystemExit(f"{args.model} transformers: generate() compiled nothing; the timings would be eager ones")
    return full, one


def decode_rate(model, ids, configs) -> tuple[torch.Tensor, float]:
    """Greedy new tokens of one compiled generate, and its decode tokens/s (the prefill's time
    taken out: a one-token generate's time is subtracted)."""
    full, one = configs
    out, t_full = timed_generate(model, ids, full)
    t_one = timed_generate(model, ids, one)[1]
    decoded = ids.shape[0] * (full.max_new_tokens - 1)
    return out[:, ids.shape[1] :].cpu(), decoded / max(t_full - t_one, 1e-9)


def with_cache(cache) -> dict:
    """The keyword argument of generate() and of a model's forward for a cache object: ``cache``
    from transformers 5.24 on (the old ``past_key_values`` warns there), ``past_key_values`` before."""
    name = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"
    return {name: cache}


def allocated(device) -> int:
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(device)


def at_least(low: int):
    """An argparse type: an integer of at least ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every Gemma example run takes: the model's size, device, batch, prompt, tokens,
    repeats and compile backend."""
    parser.add_argument("--config", choices=["tiny", "e2b"], default=None, help="default: e2b on CUDA, tiny on the CPU")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or an available CUDA device"
    )
    parser.add_argument("--batch", type=at_least(1), default=None, help="default: 8 (e2b) or 2 (tiny)")
    parser.add_argument("--prompt-len", type=at_least(1), default=16)
    # Two at least: the decode rate is (new tokens - 1) per sequence over the time beyond a
    # one-token generate.
    parser.add_argument("--new-tokens", type=at_least(2), default=None, help="default: 64 (e2b) or 12 (tiny)")
    parser.add_argument(
        "--repeats", type=at_least(1), default=None, help="timed runs of each, best taken; default 4 (e2b) or 2"
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (CompileConfig.backend)")


def run_device(parser: argparse.ArgumentParser, value: str) -> torch.device:
    """``--device`` as a ``torch.device`` this machine has (kv_ops.cuda.arguments.device's rule: no
    CUDA device where CUDA is missing or past the last GPU), of the CPU or CUDA; else a usage error."""
    try:
        found = device_argument("argument --device", value, what="the device")
    except ValueError as error:
        parser.error(str(error))
    if found.type not in ("cpu", "cuda"):
        # The runs synchronize, time and count memory the CPU's or CUDA's way; meta holds no
        # values to generate from at all.
        parser.error(f"argument --device: the device must be the CPU or a CUDA device, got {value!r}")
    return found


def run_backend(parser: argparse.ArgumentParser, name: str) -> str:
    """``--backend`` when torch.compile knows it, else a usage error: an unknown name would only
    fail inside the first generate(), after both models are built."""
    # list_backends() leaves out the debug backends (eager, aot_eager, ...), which torch.compile
    # takes all the same and which compile quickly on a CPU: every registered name is accepted.
    if name not in torch.compiler.list_backends(exclude_tags=()):
        shown = ", ".join(torch.compiler.list_backends())
        parser.error(
            f"argument --backend: torch.compile has no backend {name!r} (one of {shown}, or a debug one such as eager or aot_eager)"
        )
    return name


def run_defaults(parser: argparse.ArgumentParser, args, model: str = "gemma3n"):
    """Fill in what :func:`run_arguments` left to the size (e2b on CUDA, tiny elsewhere) and refuse,
    as usage errors before any model is built, what the run cannot do; the device and the config."""
    device = run_device(parser, args.device)
    run_backend(parser, args.backend)
    if args.config is None:
        args.config = "e2b" if device.type == "cuda" else "tiny"
    e2b = args.config == "e2b"
    for name, e2b_value, tiny_value in (("batch", 8, 2), ("new_tokens", 64, 12), ("repeats", 4, 2)):
        if getattr(args, name) is None:
            setattr(args, name, e2b_value if e2b else tiny_value)
    cfg = config(args.config, model)
    # generate() does not refuse positions past the config's max_position_embeddings, and a run
    # there measures nothing the model was configured for.
    positions, limit = args.prompt_len + args.new_tokens, cfg.max_position_embeddings
    if positions > limit:
        parser.error(
            f"argument --prompt-len/--new-tokens: --prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} "
            f"= {positions} positions, past the {args.config} config's max_position_embeddings {limit}"
        )
    return device, cfg


def parse(argv: list[str] | None = None, default_model: str = "gemma3n"):
    """The run's arguments, its device and its model's config; a usage error (exit status 2)
    for anything the run cannot do."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=MODELS, default=default_model, help=f"default: {default_model}")
    run_arguments(parser)
    args = parser.parse_args(argv)
    device, cfg = run_defaults(parser, args, args.model)
    return args, device, cfg


def main(argv: list[str] | None = None, default_model: str = "gemma3n") -> int:
    args, device, cfg = parse(argv, default_model)
    name = args.config
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ids = torch.randint(3, cfg.vocab_size, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    family = "Gemma4ForCausalLM" if args.model == "gemma4" else "Gemma3nForCausalLM"
    print(
        f"{family} ({name}: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, PLE "
        f"{cfg.hidden_size_per_layer_input}, per-layer vocab {cfg.vocab_size_per_layer_input}), {dtype}, {device}, "
        f"batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, backend {args.backend}"
    )

    # Both models stay alive and their timed runs alternate (stock, host, host, stock, ...): the
    # decode step is host-bound (generate()'s Python between replays), and a host's speed can
    # drift within a minute, so runs minutes apart would compare two hosts. Both models are built
    # from the same seed: the same weights.
    stock = build(cfg, device, dtype)
    stock_configs = warm(stock, ids, args, device)

    host = build(cfg, device, dtype)
    table = host.get_per_layer_input_embeddings().weight
    table_bytes = table.numel() * table.element_size()
    del table
    before = allocated(device)  # the stock model's memory is constant across the conversion
    host.set_per_layer_input_embeddings(ple_ops.host_embedding(host.get_per_layer_input_embeddings()))
    freed = before - allocated(device)
    host_configs = warm(host, ids, args, device)

    runs = {"stock": (stock, stock_configs), "host": (host, host_configs)}
    rates: dict[str, list[float]] = {"stock": [], "host": []}
    tokens: dict[str, list[torch.Tensor]] = {"stock": [], "host": []}
    for r in range(args.repeats):
        for name in ("stock", "host") if r % 2 == 0 else ("host", "stock"):
            model, configs = runs[name]
            out, rate = decode_rate(model, ids, configs)
            tokens[name].append(out)
            rates[name].append(rate)
    stock_tps, host_tps = max(rates["stock"]), max(rates["host"])
    stock_tokens = tokens["stock"][0]

    print(
        f"per-layer table: [{cfg.vocab_size_per_layer_input}, {cfg.num_hidden_layers * cfg.hidden_size_per_layer_input}]"
        f" {dtype}, {table_bytes / 2**20:.1f} MiB"
    )
    if device.type == "cuda":
        print(f"GPU memory freed by host_embedding: {freed / 2**20:.1f} MiB ({freed / table_bytes:.4f} of the table)")
    print("| PLE table | decode tokens/s | ratio to stock |")
    print("| --- | ---: | ---: |")
    print(f"| in the model (stock) | {stock_tps:.1f} | 1.000 |")
    print(f"| page-locked host (host_embedding) | {host_tps:.1f} | {host_tps / stock_tps:.3f} |")
    print(
        f"best of {args.repeats} alternating runs each; spread (worst/best) stock "
        f"{min(rates['stock']) / stock_tps:.3f}, host {min(rates['host']) / host_tps:.3f}"
    )
    for name, outs in tokens.items():
        for r, out in enumerate(outs):
            if not torch.equal(stock_tokens, out):
                differ = (stock_tokens != out).nonzero()[0].tolist()
                where = f"first at sequence {differ[0]}, token {differ[1]}"
                print(f"{args.model} transformers: MISMATCH ({name} run {r}: {where})")
                return 1
    if device.type == "cuda" and abs(freed - table_bytes) > 0.01 * table_bytes:
        print(f"{args.model} transformers: tokens match, but the GPU memory freed is not the table's")
        return 1
    print(f"{args.model} transformers: tokens match ({stock_tokens.numel()} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
