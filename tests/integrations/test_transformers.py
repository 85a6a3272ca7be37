"""kv_ops.integrations.transformers.HostOffloadedCache in stock generate(), against transformers' StaticCache."""

from __future__ import annotations

import contextlib
import copy
import io
import pickle
import warnings

import pytest
import torch
from packaging.version import Version
from torch.nn.attention import SDPBackend, sdpa_kernel

transformers = pytest.importorskip("transformers")
from byte_checks import as_bytes, assert_same_storages  # noqa: E402
from transformers import (  # noqa: E402
    CompileConfig,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    StaticCache,
)

from kv_ops.cuda.launch import TILE_BYTES  # noqa: E402
from kv_ops.integrations.transformers import HostOffloadedCache  # noqa: E402
from kv_ops.transfer import slot_engines  # noqa: E402
from kv_ops.transfer.slot_engines import SlotEngines  # noqa: E402

NEW = 6
gpu = pytest.mark.gpu


def llama(layers=5) -> LlamaConfig:
    # Five full-attention layers: one keeps its slot, four rotate through two (odd and even reuse).
    return LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip


def gemma3() -> Gemma3TextConfig:
    return Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"] * 4,
    )  # fmt: skip


def gemma4():
    from transformers.models.gemma4 import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, max_position_embeddings=256,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        vocab_size_per_layer_input=256, hidden_size_per_layer_input=8,
    )  # fmt: skip
    return cfg, Gemma4ForCausalLM


def gemma4_shared():
    # Eight full-attention layers with a cache and four that reuse the last ones' keys and values
    # (read straight from what its update returned, its slot): the last full layer is streamed.
    # transformers >= 5.24 lists the reusing layers as "dummy" (no cache of their own).
    from transformers.models.gemma4 import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=20, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"] * 10, vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=8, num_kv_shared_layers=4,
    )  # fmt: skip
    return cfg, Gemma4ForCausalLM


def model_of(cfg, cls, device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    return cls(cfg).to(device, dtype).eval()


def gen(compile_config=None) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None,
        return_dict_in_generate=True, output_logits=True, compile_config=compile_config,
        disable_compile=compile_config is None,
    )  # fmt: skip


def generate(model, ids, cache, config):
    with torch.no_grad():
        return model.generate(ids, past_key_values=cache, generation_config=config)


def same(a, b) -> bool:
    return torch.equal(a.sequences, b.sequences) and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def prompt(vocab, batch=2, length=9, device="cpu"):
    return torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(7)).to(device)


def models():
    yield "llama", llama(), LlamaForCausalLM
    yield "gemma3", gemma3(), Gemma3ForCausalLM
    try:
        cfg, cls = gemma4()
    except ImportError:
        return
    yield "gemma4", cfg, cls
    yield "gemma4-shared-kv", *gemma4_shared()


def full_layers(cache) -> list[int]:
    return [i for i, layer in enumerate(cache.layers) if type(layer).__name__ == "HostOffloadedLayer"]


@pytest.mark.parametrize(("name", "cfg", "cls"), list(models()), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("capacity", [1, 4])
@pytest.mark.parametrize("ahead", [False, True])
def test_eager_generate_is_bitwise_the_static_caches(name, cfg, cls, capacity, ahead):
    # With load_ahead the last full-attention layer keeps its slot, which Gemma 4's layers that
    # share keys and values read after it.
    model, ids = model_of(cfg, cls), prompt(cfg.vocab_size)
    length = (ids.shape[1] + NEW) * capacity
    want = generate(model, ids, StaticCache(config=cfg, max_cache_len=length), gen())
    cache = HostOffloadedCache(config=cfg, max_cache_len=length, load_ahead=ahead)
    assert same(generate(model, ids, cache, gen()), want)
    full = full_layers(cache)
    assert full == cache.offloaded and len(full) >= 2
    assert len(cache.loads.slots) == min(3, len(full))  # the GPU holds the slots, the host the rest
    streamed = [cache.offloaded[k] for k in cache.loads.plan.streamed]
    kept = -1 if ahead else 0
    assert cache.resident() == [i for i in full if i not in streamed] and cache.resident()[kept] == full[kept]
    # All but the first, except that three slots hold three layers, and three streamed would leave
    # one alone in a slot (it stays resident).
    assert len(streamed) == {2: 0, 3: 0, 4: 2}.get(len(full), len(full) - 1)


def test_generate_takes_the_cache_by_this_transformers_name_for_it_without_a_warning():
    # transformers 5.24 renames generate()'s past_key_values to cache (the old name warns there).
    name = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    want = generate(model, ids, StaticCache(config=cfg, max_cache_len=64), gen())
    cache = HostOffloadedCache(config=cfg, max_cache_len=64)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        got = model.generate(ids, generation_config=gen(), **{name: cache})
    assert same(got, want)
    assert cache.get_seq_length() == ids.shape[1] + NEW - 1  # generate() wrote into this cache
    assert cache.loads.moved > 0


def held_after_the_step(cache) -> list[int]:
    """Which layer each of the next step's first loads finds in its slot: the layer itself where
    the step before loaded it ahead, else the slot's last layer."""
    plan = cache.loads.plan
    return [int(cache.loads.held[plan.slot[k]]) for k in plan.issues[0]]


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_generate_is_bitwise_the_static_caches(backend, ahead):
    torch._dynamo.reset()  # each plan compiles a step of its own: keep the file under the recompile limit
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True  # transformers compiles only on accelerators otherwise
    length = 4 * (ids.shape[1] + NEW)
    want = generate(model, ids, StaticCache(config=cfg, max_cache_len=length), gen(config))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    cache = HostOffloadedCache(config=cfg, max_cache_len=length, load_ahead=ahead)
    got = generate(model, ids, cache, gen(config))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # the decode step was compiled
    assert same(got, want)
    assert cache.loads.moved > 0  # the compiled steps ran the loads
    first = list(cache.loads.plan.issues[0])
    assert (held_after_the_step(cache) == first) == ahead  # the last step loaded the next one's ahead


def test_a_new_cache_per_request_reuses_the_compiled_step_and_a_live_one_keeps_its_name_until_closed():
    # The ops carry the cache's name, which the compiled step is specialised on: a cache made per
    # request takes the name of the one dropped before it, so it is compiled once, as StaticCache
    # is (a name per cache recompiled every request, and ran eagerly past Dynamo's limit).
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True
    length = 4 * (ids.shape[1] + NEW)
    want = generate(model, ids, StaticCache(config=cfg, max_cache_len=length), gen(config))
    names, graphs = [], []
    for _ in range(3):
        cache = HostOffloadedCache(config=cfg, max_cache_len=length)
        assert same(generate(model, ids, cache, gen(config)), want)
        names.append(cache.name)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        del cache
    assert len(set(names)) == 1 and graphs[0] == graphs[-1], (names, graphs)
    # Caches alive together have names of their own; a closed one gives its name up.
    first, second = (HostOffloadedCache(config=cfg, max_cache_len=length) for _ in range(2))
    assert first.name != second.name
    generate(model, ids, first, gen(config))
    first.close()
    third = HostOffloadedCache(config=cfg, max_cache_len=length)
    assert third.name == first.name
    with pytest.raises(ValueError, match=rf"'{first.name}' was closed"):  # the eager prefill refuses it
        generate(model, ids, first, gen(config))
    assert same(generate(model, ids, third, gen(config)), want)


def test_a_prefetch_handed_another_caches_host_copy_is_refused():
    # The op checks the host copy and saved counts it is handed against those its name's loads
    # are bound to: a step compiled or captured for one cache must not drive another's loads.
    cfg = llama(layers=6)
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    cache = HostOffloadedCache(config=cfg, max_cache_len=32)
    generate(model, ids, cache, gen())
    loads = cache.loads
    first, second = loads.plan.streamed[:2]
    slot_k, slot_v = loads.slots[loads.plan.slot[first]]
    lengths = loads.lengths
    args = (slot_k, slot_v, ids, lengths[first], lengths[loads.plan.evicts[first]])
    before = [t.clone() for t in (slot_k, slot_v)]
    with pytest.raises(
        RuntimeError, match=rf"the step hands layer {first} of '{cache.name}' another cache's host copy"
    ):
        torch.ops.kv_ops.prefetch_layer(*args, *loads.host_views[second], loads.saved[:1], loads.name, first)
    with pytest.raises(RuntimeError, match="another cache's host copy"):
        torch.ops.kv_ops.prefetch_layer(*args, *loads.host_views[first], loads.saved.clone()[:1], loads.name, first)
    assert all(torch.equal(a, b) for a, b in zip(before, (slot_k, slot_v)))


def beams(n: int, compile_config=None) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=NEW, min_new_tokens=NEW, num_beams=n, do_sample=False, pad_token_id=0, eos_token_id=None,
        return_dict_in_generate=True, output_logits=True, output_scores=True, compile_config=compile_config,
        disable_compile=compile_config is None,
    )  # fmt: skip


def same_beams(a, b) -> bool:
    return same(a, b) and torch.equal(a.sequences_scores, b.sequences_scores)


def addresses(cache) -> list[int]:
    loads = cache.loads
    return [t.data_ptr() for pair in loads.slots + list(loads.host.values()) for t in pair]


@pytest.mark.parametrize(("name", "cfg", "cls"), list(models())[:2], ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("ahead", [False, True])
def test_beam_search_is_bitwise_the_static_caches_and_keeps_every_address(name, cfg, cls, n, ahead):
    # generate() reorders the cache after every step: each beam takes the rows of the beam it
    # continues, in the slots and in the streamed layers' host copies alike.
    model, ids = model_of(cfg, cls), prompt(cfg.vocab_size)
    length = 4 * (ids.shape[1] + NEW)
    want = generate(model, ids, StaticCache(config=cfg, max_cache_len=length), beams(n))
    cache = HostOffloadedCache(config=cfg, max_cache_len=length, load_ahead=ahead)
    with torch.no_grad():  # allocate at the beams' batch, to see that no address moves after
        model(prompt(cfg.vocab_size, batch=ids.shape[0] * n), past_key_values=cache, use_cache=True)
    cache.reset()
    before = addresses(cache)
    got = generate(model, ids, cache, beams(n))
    assert same_beams(got, want)
    # The control: some beam continued another beam's sequence, so the reorder moved rows.
    paths = got.beam_indices[:, : NEW - 1]
    assert (paths[:, 1:] != paths[:, :-1]).any()
    assert addresses(cache) == before


@pytest.mark.parametrize(("held", "resident"), [(2, 1), (4, 2)])  # one shared slot; two
@pytest.mark.parametrize("ahead", [False, True])
def test_beam_search_under_a_budget_is_bitwise_the_static_caches(held, resident, ahead):
    cfg = llama(layers=8)
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    length = 4 * (ids.shape[1] + NEW)
    layer = 2 * ids.shape[0] * 3 * cfg.num_key_value_heads * cfg.head_dim * 4 * length  # K and V, 3 beams, float32
    want = generate(model, ids, StaticCache(config=cfg, max_cache_len=length), beams(3))
    cache = HostOffloadedCache(config=cfg, max_cache_len=length, max_gpu_bytes=held * layer, load_ahead=ahead)
    assert same_beams(generate(model, ids, cache, beams(3)), want)
    assert len(cache.resident()) == resident and len(cache.loads.slots) == held


def test_reordering_one_layer_or_resizing_the_batch_is_refused():
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    cache = HostOffloadedCache(config=cfg, max_cache_len=32)
    generate(model, ids, cache, gen())
    layer = cache.layers[cache.offloaded[1]]
    with pytest.raises(NotImplementedError, match="reorder the whole cache"):
        layer.reorder_cache(torch.tensor([1, 0]))
    with pytest.raises(NotImplementedError, match="cannot be repeated"):
        cache.batch_repeat_interleave(2)
    with pytest.raises(NotImplementedError, match="the batch is fixed"):
        cache.batch_select_indices(torch.tensor([0]))


def everything_held(cache) -> list[torch.Tensor]:
    """Copies of what the cache holds: its slots, the positions written into its host copies, and
    its sliding-window layers' keys and values."""
    windowed = [
        t for i, layer in enumerate(cache.layers) if i not in cache.offloaded for t in (layer.keys, layer.values)
    ]
    loads, written = cache.loads, cache.loads.written()
    host = [t[:, :, : written[k]] for k, pair in loads.host.items() for t in pair]
    return [t.clone() for pair in loads.slots for t in pair] + [t.clone() for t in host + windowed]


@pytest.mark.parametrize(
    ("beam_idx", "message"),
    [
        (torch.tensor([1, 2]), r"holds rows 1 to 2, outside \[0, 2\)"),
        (torch.tensor([-1, 0]), r"holds rows -1 to 0, outside \[0, 2\)"),
        (torch.tensor([0, 1, 0]), "must be a 1-D int32 or int64 tensor of 2 row indices, got a torch.int64 tensor"),
        (torch.tensor([[0, 1]]), "got a torch.int64 tensor of shape \\(1, 2\\)"),
        (torch.tensor([0.0, 1.0]), "got a torch.float32 tensor"),
        (torch.tensor([False, True]), "got a torch.bool tensor"),
        ([1, 0], "got list with 2 entries"),
    ],
    ids=["past-the-batch", "negative", "too-long", "2-D", "float", "bool", "list"],
)
def test_a_bad_beam_idx_is_refused_before_any_row_moves(beam_idx, message):
    # On a GPU an index out of range would be a device-side assert, which ends the process's CUDA.
    cfg, cls = gemma3(), Gemma3ForCausalLM  # sliding-window layers too: transformers reorders those
    model, ids = model_of(cfg, cls), prompt(cfg.vocab_size)
    cache = HostOffloadedCache(config=cfg, max_cache_len=32)
    generate(model, ids, cache, gen())
    before = everything_held(cache)
    with pytest.raises(ValueError, match=rf"HostOffloadedCache.reorder_cache: beam_idx .*{message}"):
        cache.reorder_cache(beam_idx)
    # Bit for bit: a host copy's positions past what its layer saved there were never written
    # (uninitialised memory, which can hold NaNs, never equal to themselves).
    assert_same_storages(everything_held(cache), before)
    cache.reorder_cache(torch.tensor([1, 1]))  # a good one, repeating a row as beam search may
    assert all(torch.equal(as_bytes(t[0]), as_bytes(t[1])) for t in everything_held(cache))


@pytest.mark.parametrize(("name", "cfg", "cls"), list(models())[:2], ids=lambda v: v if isinstance(v, str) else "")
def test_a_first_step_under_capture_is_refused_before_anything_is_allocated(name, cfg, cls, monkeypatch):
    # Nothing captures on a CPU: the capture state is stood in, at the module's own check (the gpu
    # test captures for real). Gemma 3's first layer is a sliding-window one: it must refuse too.
    import kv_ops.integrations.transformers as integration

    model, ids = model_of(cfg, cls), prompt(cfg.vocab_size)
    cache = HostOffloadedCache(config=cfg, max_cache_len=32)
    with monkeypatch.context() as patch:
        patch.setattr(integration, "capturing", lambda device: True)
        with pytest.raises(RuntimeError, match="a CUDA graph cannot capture the first step"), torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
    assert cache.loads.plan is None and not any(getattr(layer, "is_initialized", False) for layer in cache.layers)
    want = generate(model, ids, StaticCache(config=cfg, max_cache_len=32), gen())
    assert same(generate(model, ids, cache, gen()), want)


def test_a_closed_cache_is_neither_reordered_nor_copied():
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    cache = HostOffloadedCache(config=cfg, max_cache_len=32)
    generate(model, ids, cache, gen())
    before = everything_held(cache)
    cache.close()
    for use in (lambda: cache.reorder_cache(torch.tensor([1, 0])), lambda: copy.deepcopy(cache)):
        with pytest.raises(ValueError, match=rf"HostOffloadedCache: '{cache.name}' was closed"):
            use()
    assert_same_storages(everything_held(cache), before)


@pytest.mark.parametrize("layer_idx", [3, -1])
def test_a_layer_the_config_lacks_is_refused(layer_idx):
    # A model with more layers than the cache's config reaches its first layer past them; -1 must
    # not read as Python's last layer.
    cache = HostOffloadedCache(config=llama(layers=3), max_cache_len=32)
    keys = torch.randn(2, 2, 9, 16)
    with pytest.raises(ValueError, match=rf"HostOffloadedCache: no layer_idx {layer_idx} in the config's 3 layers"):
        cache.update(keys, keys.clone(), layer_idx)
    assert cache.loads.plan is None  # nothing allocated


def prefix_cached(model, cfg, cache, device="cpu"):
    """transformers' prefix caching: fill ``cache`` with a shared prompt, then answer each of two
    requests (the prompt and a tail of its own) from a ``copy.deepcopy`` of it, then the prompt
    cache itself with a third tail: the copies must leave it as it was."""
    shared = prompt(cfg.vocab_size, device=device)
    with torch.no_grad():
        model(shared, past_key_values=cache, use_cache=True)
    outs, copies = [], []
    for length in (3, 4, 5):
        tail = torch.randint(
            1, cfg.vocab_size, (shared.shape[0], length), generator=torch.Generator().manual_seed(length)
        )
        request = copy.deepcopy(cache) if length < 5 else cache
        outs.append(generate(model, torch.cat([shared, tail.to(device)], 1), request, gen()))
        copies.append(request)
    return outs, copies


@pytest.mark.parametrize(
    ("name", "cfg", "cls", "budget"),
    [("llama", llama(), LlamaForCausalLM, None), ("gemma3", gemma3(), Gemma3ForCausalLM, None),
     ("llama-one-shared-slot", llama(), LlamaForCausalLM, 2)],
    ids=lambda v: v if isinstance(v, str) else "",
)  # fmt: skip
@pytest.mark.parametrize("ahead", [False, True])
def test_prefix_caching_by_deepcopy_is_bitwise_the_static_caches(name, cfg, cls, budget, ahead):
    model, length = model_of(cfg, cls), 4 * (9 + 5 + NEW)
    want, _ = prefix_cached(model, cfg, StaticCache(config=cfg, max_cache_len=length))
    layer = 2 * 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * length  # K and V, batch 2, float32
    budget = None if budget is None else budget * layer
    cache = HostOffloadedCache(config=cfg, max_cache_len=length, max_gpu_bytes=budget, load_ahead=ahead)
    got, caches = prefix_cached(model, cfg, cache)
    assert all(same(a, b) for a, b in zip(got, want, strict=True))
    # Each copy has its own name, slots and host copies, and streams layers as the original does.
    assert len({c.name for c in caches}) == 3
    assert len({p for c in caches for p in addresses(c)}) == 3 * len(addresses(caches[0]))
    assert all(c.loads.plan == caches[2].loads.plan and c.loads.moved > 0 for c in caches)


def test_early_initialization_and_a_second_turn_are_bitwise_the_static_caches():
    # Allocated ahead (transformers' export recipes), then a chat's second turn continues the cache.
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    outs = {}
    for cls in (StaticCache, HostOffloadedCache):
        cache = cls(config=cfg, max_cache_len=4 * (ids.shape[1] + 3 + 2 * NEW))
        cache.early_initialization(ids.shape[0], cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
        first = generate(model, ids, cache, gen())
        reply = torch.cat([first.sequences, prompt(cfg.vocab_size, length=3)], 1)
        outs[cls] = first, generate(model, reply, cache, gen())
    assert all(same(a, b) for a, b in zip(outs[HostOffloadedCache], outs[StaticCache], strict=True))


def test_copying_one_layer_is_refused():
    cfg = llama()
    cache = HostOffloadedCache(config=cfg, max_cache_len=32)
    with pytest.raises(NotImplementedError, match=r"copy the whole cache \(copy.deepcopy\(cache\)\)"):
        copy.deepcopy(cache.layers[1])


def test_assisted_generation_is_bitwise_the_static_caches(monkeypatch):
    # The assistant's rejected tokens are cropped from the cache (its lengths go back), and the
    # next step writes over them: in a streamed layer's slot, and on its host copy when evicted.
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size, batch=1)
    torch.manual_seed(1)
    assistant = LlamaForCausalLM(llama(layers=2)).eval()
    config = gen()
    config.num_assistant_tokens = 3
    length = 4 * (ids.shape[1] + NEW)
    crops = []
    crop = HostOffloadedCache.crop
    monkeypatch.setattr(HostOffloadedCache, "crop", lambda self, n: (crops.append(n), crop(self, n)))
    with torch.no_grad():
        try:
            want = model.generate(ids, past_key_values=StaticCache(config=cfg, max_cache_len=length),
                                  generation_config=config, assistant_model=assistant)  # fmt: skip
        except ValueError as error:  # transformers < 5.24 has no crop for a static cache
            if "not supported with Static cache" not in str(error):
                raise
            pytest.skip(f"transformers {transformers.__version__} refuses assisted generation with StaticCache")
        got = model.generate(ids, past_key_values=HostOffloadedCache(config=cfg, max_cache_len=length),
                             generation_config=config, assistant_model=assistant)  # fmt: skip
    assert same(got, want)
    assert crops  # the control: some of the assistant's tokens were rejected and cropped


def test_the_bytes_a_step_moves_follow_the_sequence_not_max_cache_len():
    # Count what the loads really copy (the CPU path counts every byte) over the decode steps, at
    # 1x and 8x the sequence: the same bytes, and exactly the positions in use.
    cfg = llama(layers=5)
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size, batch=3)
    moved = {}
    for capacity in (1, 8):
        cache = HostOffloadedCache(config=cfg, max_cache_len=capacity * (ids.shape[1] + NEW))
        with torch.no_grad():
            token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            # The first decode step also writes back the prompt of the layers whose slots it takes.
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            before = cache.loads.moved
            predicted = cache.bytes_per_step()
            model(token, past_key_values=cache, use_cache=True)
        moved[capacity] = cache.loads.moved - before
        assert moved[capacity] == sum(predicted)  # what bytes_per_step() says is what moves
    per_position = 2 * 3 * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, batch 3, float32
    streamed = 4  # every full-attention layer but the first
    # Each streamed layer's positions so far come in, and its one new position goes out.
    assert moved[1] == moved[8] == streamed * (ids.shape[1] + 1 + 1) * per_position


def test_each_eager_step_tells_its_loads_the_positions_before_it_and_the_copy_engine_takes_them_from_from_bytes(
    monkeypatch,
):
    # The positions every streamed layer's host copy holds before a step are the tokens before it;
    # its loads' copy-engine part takes them where they are FROM_BYTES a layer or more (here from
    # 12 positions), else none: the kernel moves every position.
    cfg = llama(layers=5)
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size, batch=3)
    position = 3 * cfg.num_key_value_heads * 2 * cfg.head_dim * 4  # batch 3, keys and values, float32
    monkeypatch.setattr(slot_engines, "FROM_BYTES", 12 * position)
    cache = HostOffloadedCache(config=cfg, max_cache_len=4 * (ids.shape[1] + NEW))
    told = []
    with torch.no_grad():
        token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        told.append(cache.loads.known)
        for _ in range(4):
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            told.append(cache.loads.known)
    assert cache.loads.position_bytes == position
    assert told == [0, 0, 0, 0, 12]  # the prefill, then decode steps after 9 (the prompt), 10, 11 and 12 tokens


@pytest.mark.parametrize("ahead", [True, False, None])  # None: the default, off
def test_with_load_ahead_each_step_loads_the_next_steps_first_layers_and_no_load_moves_twice(ahead):
    # With load_ahead a step loads the next step's first layers once it has read their slots, and
    # the next step's own loads of them move nothing (the claim): each step moves what
    # bytes_per_step() says plus the one position each layer loaded ahead has gained since.
    cfg = llama(layers=5)
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size, batch=3)
    want = HostOffloadedCache(config=cfg, max_cache_len=4 * (ids.shape[1] + NEW), load_ahead=False)
    chosen = {} if ahead is None else {"load_ahead": ahead}
    cache = HostOffloadedCache(config=cfg, max_cache_len=4 * (ids.shape[1] + NEW), **chosen)
    per_position = 2 * 3 * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, batch 3, float32
    with torch.no_grad():
        for c in (want, cache):  # the prefill, and a first step that writes the prompt back
            token = model(ids, past_key_values=c, use_cache=True).logits[:, -1:].argmax(-1)
            token = model(token, past_key_values=c, use_cache=True).logits[:, -1:].argmax(-1)
        plan = cache.loads.plan
        # Ahead, the last layer keeps its slot and the first streams; else the other way round.
        assert cache.resident() == [cfg.num_hidden_layers - 1 if ahead else 0]
        for _ in range(3):
            predicted, before = sum(cache.bytes_per_step()), cache.loads.moved
            logits = model(token, past_key_values=cache, use_cache=True).logits
            assert torch.equal(logits, model(token, past_key_values=want, use_cache=True).logits)
            gained = len(plan.issues[0]) * per_position if ahead else 0
            assert cache.loads.moved - before == predicted + gained
            assert (held_after_the_step(cache) == list(plan.issues[0])) == bool(ahead)
            token = logits[:, -1:].argmax(-1)


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_generate_loads_ahead_in_every_step(backend):
    # Every forward, the prefill too, queues the next step's first loads (eagerly, or through
    # kv_ops.queue_ahead compiled), each moving bytes: count them in a real generate().
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    config = None
    if backend is not None:
        config = CompileConfig(fullgraph=True, backend=backend, mode=None)
        config._compile_all_devices = True  # transformers compiles only on accelerators otherwise
    length = 4 * (ids.shape[1] + NEW)
    want = generate(model, ids, StaticCache(config=cfg, max_cache_len=length), gen(config))
    cache = HostOffloadedCache(config=cfg, max_cache_len=length, load_ahead=True)
    ahead = []

    def counted(queue_ahead):
        def queue(k, tensors=None):
            before = cache.loads.moved
            queue_ahead(k, tensors)
            ahead.append((k, cache.loads.moved - before))

        return queue

    with torch.no_grad():  # the prefill allocates the loads; then count
        model(ids[:, :1], past_key_values=cache, use_cache=True)
    cache.reset()
    cache.loads.queue_ahead = counted(cache.loads.queue_ahead)
    assert same(generate(model, ids, cache, gen(config)), want)
    first = cache.loads.plan.issues[0]
    assert [k for k, _ in ahead] == sorted(first, key=lambda k: cache.loads.plan.evicts[k]) * NEW
    assert all(moved > 0 for _, moved in ahead)


def test_a_step_compiled_as_a_model_loads_ahead_and_gives_the_static_caches_logits():
    # Called as a model, not through generate(): the compiled step itself queues the next step's
    # first loads (kv_ops.queue_ahead) and waits for the last step's (kv_ops.join_ahead).
    torch._dynamo.reset()  # a step of its own, whatever this process compiled before
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    length = 4 * (ids.shape[1] + NEW)
    static, cache = (
        StaticCache(config=cfg, max_cache_len=length),
        HostOffloadedCache(config=cfg, max_cache_len=length, load_ahead=True),
    )
    step = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        token = model(ids, past_key_values=static, use_cache=True).logits[:, -1:].argmax(-1)
        model(ids, past_key_values=cache, use_cache=True)
        first = list(cache.loads.plan.issues[0])
        for _ in range(3):
            before = cache.loads.moved
            want = step(token, past_key_values=static, use_cache=True).logits
            assert torch.equal(step(token, past_key_values=cache, use_cache=True).logits, want)
            assert cache.loads.moved > before  # the compiled step loaded
            assert held_after_the_step(cache) == first  # and loaded the next step's first layers ahead
            token = want[:, -1:].argmax(-1)


def test_inductor_keeps_the_loads_ahead_between_the_reads_they_follow_and_precede():
    # The order Inductor's code calls the step's ops in: the join first, before the first layer's loads,
    # and each load ahead after the wait of the layer that last read its slot (Inductor would be
    # free to sink an op it sees no reader of to the step's end, or to hoist it to its start).
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    cfg = llama()  # five layers: 0-3 take turns in slots 1 and 2, layer 4 keeps slot 0
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    cache = HostOffloadedCache(config=cfg, max_cache_len=4 * (ids.shape[1] + NEW), load_ahead=True)
    with torch.no_grad():
        token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        step = torch.compile(model, backend="inductor", fullgraph=True)
        _, (code, *_) = run_and_get_code(step, token, past_key_values=cache, use_cache=True)
    plan = cache.loads.plan
    assert plan.ahead == {3: (0,), 4: (1,)} and plan.issues[0] == (0, 1)
    # One call a line, ending with the name and, where the op takes one, the layer.
    calls = [
        (op, int(layer) if layer else None)
        for op, layer in re.findall(r"kv_ops\.(\w+)\.default\(.*'(?:, (\d+))?\)$", code, re.MULTILINE)
    ]
    at = {call: i for i, call in enumerate(calls)}
    assert at[("join_ahead", None)] < min(at[("prefetch_layer", 0)], at[("prefetch_layer", 1)]), calls
    # The join takes only a step input: it runs before any of the step's kernels, so with CUDA
    # graphs it does not split off a graph of the step's first kernels.
    body = code[code.index("def call(") :]
    first_kernel = min(body.find(k) for k in ("cpp_fused", "extern_kernels.") if k in body)
    assert body.index("kv_ops.join_ahead") < first_kernel
    assert at[("wait_layer", 2)] < at[("queue_ahead", 0)], calls  # layer 2 last read slot 1
    assert at[("wait_layer", 3)] < at[("queue_ahead", 1)], calls  # layer 3 last read slot 2
    # Handed the slots themselves (the step's inputs), not clones it would copy back after the step.
    assert len(re.findall(r"kv_ops\.queue_ahead\.default\(arg\d+_1, arg\d+_1, arg\d+_1, arg\d+_1,", code)) == 2


def test_a_load_ahead_that_no_step_follows_leaves_the_cache_right():
    # The last step of a generate() loads ahead for a step that never comes: then a reset, or a
    # deep copy. The slots hold the layers loaded ahead, and every later step is still
    # StaticCache's, bit for bit.
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    length = 4 * (ids.shape[1] + NEW)
    static = StaticCache(config=cfg, max_cache_len=length)
    want = generate(model, ids, static, gen())
    cache = HostOffloadedCache(config=cfg, max_cache_len=length, load_ahead=True)
    generate(model, ids.flip(1), cache, gen())
    assert held_after_the_step(cache) == list(cache.loads.plan.issues[0])  # the control: it loaded ahead
    cache.reset()
    assert same(generate(model, ids, cache, gen()), want)
    twin = copy.deepcopy(cache)
    last = want.sequences[:, -1:]
    with torch.no_grad():
        expected = model(last, past_key_values=static, use_cache=True).logits
        for c in (twin, cache):
            assert torch.equal(model(last, past_key_values=c, use_cache=True).logits, expected)


def test_the_decode_steps_read_the_host_copy():
    # The control: after the prefill, overwrite one streamed layer's host copy; the next steps read it
    # (the slot is refilled from it), so the logits change. A cache that kept layers on the GPU would not.
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    length = ids.shape[1] + NEW
    cache = HostOffloadedCache(config=cfg, max_cache_len=length)
    with torch.no_grad():
        first = model(ids, past_key_values=cache, use_cache=True).logits
        k, _ = cache.loads.host[2]  # the third full-attention layer, streamed
        k[:, :, : ids.shape[1]] = torch.randn(k[:, :, : ids.shape[1]].shape, generator=torch.Generator().manual_seed(3))
        step = model(first[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits
    fresh = HostOffloadedCache(config=cfg, max_cache_len=length)
    with torch.no_grad():
        model(ids, past_key_values=fresh, use_cache=True)
        want = model(first[:, -1:].argmax(-1), past_key_values=fresh, use_cache=True).logits
    assert not torch.equal(step, want)


def test_reset_serves_a_second_prompt_like_a_fresh_cache():
    cfg = llama()
    model = model_of(cfg, LlamaForCausalLM)
    a, b = prompt(cfg.vocab_size), prompt(cfg.vocab_size).flip(1)
    cache = HostOffloadedCache(config=cfg, max_cache_len=a.shape[1] + NEW)
    generate(model, a, cache, gen())
    cache.reset()
    want = generate(model, b, StaticCache(config=cfg, max_cache_len=b.shape[1] + NEW), gen())
    assert same(generate(model, b, cache, gen()), want)


def test_bytes_per_step_and_gpu_bytes_count_the_streamed_layers():
    cfg = llama(layers=5)
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size, batch=3)
    length = 4 * (ids.shape[1] + NEW)
    cache = HostOffloadedCache(config=cfg, max_cache_len=length)
    generate(model, ids, cache, gen())
    per_position = 2 * 3 * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, float32
    held = ids.shape[1] + NEW - 1  # the last new token is sampled, never cached
    assert cache.bytes_per_step() == (4 * held * per_position, 4 * per_position)
    assert cache.gpu_bytes() == 3 * length * per_position


@pytest.mark.parametrize(("held", "resident"), [(8, 8), (2, 1), (3, 1), (5, 3), (6, 4)])
@pytest.mark.parametrize("ahead", [False, True])
def test_a_gpu_budget_keeps_that_many_layers_and_streams_the_rest(held, resident, ahead):
    cfg = llama(layers=8)
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    length = 4 * (ids.shape[1] + NEW)
    per_position = 2 * ids.shape[0] * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, float32
    layer = per_position * length
    want = generate(model, ids, StaticCache(config=cfg, max_cache_len=length), gen())
    budget = held * layer + layer // 2  # half a layer spare, which holds nothing
    cache = HostOffloadedCache(config=cfg, max_cache_len=length, max_gpu_bytes=budget, load_ahead=ahead)
    assert same(generate(model, ids, cache, gen()), want)
    assert len(cache.resident()) == resident and (7 in cache.resident()) == (ahead or held == 8)
    assert cache.gpu_bytes() == held * layer
    streamed = 8 - resident
    assert (cache.loads.moved > 0) == (streamed > 0)
    assert cache.bytes_per_step() == (streamed * (ids.shape[1] + NEW - 1) * per_position, streamed * per_position)


def test_a_budget_below_the_slots_is_refused_naming_the_minimum():
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    layer = 2 * ids.shape[0] * cfg.num_key_value_heads * cfg.head_dim * 4 * 32
    cache = HostOffloadedCache(config=cfg, max_cache_len=32, max_gpu_bytes=2 * layer - 1)
    with pytest.raises(
        ValueError, match=f"max_gpu_bytes={2 * layer - 1} is below the 2 layer slots .*: {2 * layer} bytes"
    ):
        generate(model, ids, cache, gen())
    assert cache.loads.slots == [] and cache.loads.host == {}


# --- what it refuses ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -3, 2.0, True, "16"])
def test_a_max_cache_len_that_is_not_a_positive_integer_is_refused(value):
    with pytest.raises(
        ValueError, match=f"HostOffloadedCache: max_cache_len must be a positive integer, got {value!r}"
    ):
        HostOffloadedCache(config=llama(), max_cache_len=value)


@pytest.mark.parametrize("value", [0, -1, 1.5, "1GB"])
def test_a_max_gpu_bytes_that_is_not_a_positive_integer_is_refused(value):
    with pytest.raises(
        ValueError, match=f"HostOffloadedCache: max_gpu_bytes must be a positive integer, got {value!r}"
    ):
        HostOffloadedCache(config=llama(), max_cache_len=32, max_gpu_bytes=value)


@pytest.mark.parametrize("value", [1, "no", None, torch.tensor(True)])
def test_a_load_ahead_that_is_not_a_bool_is_refused(value):
    with pytest.raises(ValueError, match="HostOffloadedCache: load_ahead must be True or False, got "):
        HostOffloadedCache(config=llama(), max_cache_len=32, load_ahead=value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_gpu_byte": 1 << 20}, r"unknown keyword argument\(s\) \['max_gpu_byte'\]; it takes config, max_cache_len"),
     ({"offloading": True}, "offloading=True is StaticCache's own offloading")],
)  # fmt: skip
def test_a_misspelt_or_foreign_keyword_argument_is_refused(kwargs, message):
    # A misspelt budget would otherwise leave the default in place, unnoticed.
    with pytest.raises(ValueError, match=f"HostOffloadedCache: {message}"):
        HostOffloadedCache(config=llama(), max_cache_len=32, **kwargs)
    # StaticCache's own arguments that mean nothing different here pass.
    HostOffloadedCache(config=llama(), max_cache_len=32, dtype=torch.float32, offloading=False)


def test_a_cpu_device_by_index_is_the_cpu():
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    want = generate(model, ids, StaticCache(config=cfg, max_cache_len=32), gen())
    for device in ("cpu:0", torch.device("cpu", 0)):
        assert same(generate(model, ids, HostOffloadedCache(config=cfg, max_cache_len=32, device=device), gen()), want)


def test_max_batch_size_is_the_cap_given_else_the_allocated_batch():
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size, batch=3)
    capped, uncapped = (HostOffloadedCache(config=cfg, max_cache_len=32, max_batch_size=b) for b in (8, None))
    assert (capped.max_batch_size, uncapped.max_batch_size) == (8, -1)
    for cache in (capped, uncapped):
        generate(model, ids, cache, gen())
    assert (capped.max_batch_size, uncapped.max_batch_size, capped.batch_size) == (8, 3, 3)


def test_pickling_is_refused_and_a_shallow_copy_is_the_same_cache():
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    cache = HostOffloadedCache(config=cfg, max_cache_len=32)
    generate(model, ids, cache, gen())
    # A pickled copy would carry the name of this process's loads (and none of their memory).
    for save in (pickle.dumps, lambda c: torch.save(c, io.BytesIO())):
        with pytest.raises(TypeError, match="HostOffloadedCache cannot be pickled .* copy.deepcopy"):
            save(cache)
    shallow = copy.copy(cache)
    assert shallow.loads is cache.loads and shallow.layers is cache.layers


def test_a_streamed_layers_keys_are_refused_where_its_slot_holds_another_layer():
    # Between steps a shared slot holds the last layer loaded into it; the layers before it in
    # that slot have their keys on the host only.
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    cache, static = HostOffloadedCache(config=cfg, max_cache_len=32), StaticCache(config=cfg, max_cache_len=32)
    generate(model, ids, cache, gen())
    generate(model, ids, static, gen())
    plan, full = cache.loads.plan, cache.offloaded
    last = {plan.slot[k]: k for k in plan.streamed}  # per shared slot, the last streamed layer in it
    n = ids.shape[1] + NEW - 1
    for k, i in enumerate(full):
        layer = cache.layers[i]
        if k not in plan.evicts or last[plan.slot[k]] == k:  # resident, or its slot holds it
            assert torch.equal(layer.keys[:, :, :n], static.layers[i].keys[:, :, :n])
        else:
            with pytest.raises(RuntimeError, match=rf"layer {i}'s keys and values are streamed .* holds layer "):
                _ = layer.values


def test_as_an_encoder_decoders_cross_attention_cache_it_is_refused():
    # Bart reads the cross-attention keys straight from the layers after the first step, which a
    # streamed layer's slot no longer holds; as the decoder's self-attention cache it serves.
    from transformers import BartConfig, BartForConditionalGeneration, EncoderDecoderCache

    cfg = BartConfig(
        vocab_size=256, d_model=64, encoder_layers=5, decoder_layers=5, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=256,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip
    model, ids = model_of(cfg, BartForConditionalGeneration), prompt(cfg.vocab_size)
    length = ids.shape[1]

    def run(self_cls, cross_cls):
        caches = [cls(config=cfg, max_cache_len=n) for cls, n in ((self_cls, 32), (cross_cls, length))]
        return generate(model, ids, EncoderDecoderCache(*caches), gen())

    assert same(run(HostOffloadedCache, StaticCache), run(StaticCache, StaticCache))
    with pytest.raises(RuntimeError, match="keys and values are streamed .* cross-attention cache"):
        run(StaticCache, HostOffloadedCache)


def test_a_crop_gives_back_its_tokens_to_max_cache_len():
    # Assisted generation crops its rejected tokens: a cache sized for the tokens kept must hold.
    if not hasattr(transformers.cache_utils.StaticLayer, "crop"):
        pytest.skip(f"transformers {transformers.__version__}'s static layers cannot be cropped")
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    logits = {}
    for cls in (StaticCache, HostOffloadedCache):
        cache = cls(config=cfg, max_cache_len=ids.shape[1] + 3)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            cache.crop(-3)
            logits[cls] = model(ids[:, :6], past_key_values=cache, use_cache=True).logits
    assert torch.equal(logits[HostOffloadedCache], logits[StaticCache])


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_a_crop_of_more_tokens_than_cached_empties_the_cache(name):
    # StaticCache's lengths go below zero here, and its next step fails to write at negative
    # positions; this cache clamps them to zero (the windowed layers' too: Gemma 3's window here
    # is past the sequence, where a crop can undo it) and then runs as a new StaticCache does.
    if not hasattr(transformers.cache_utils.StaticLayer, "crop"):
        pytest.skip(f"transformers {transformers.__version__}'s static layers cannot be cropped")
    cfg, cls = (llama(), LlamaForCausalLM) if name == "llama" else (gemma3(), Gemma3ForCausalLM)
    if name == "gemma3":
        cfg.sliding_window = 64
    model, ids = model_of(cfg, cls), prompt(cfg.vocab_size)
    length = 4 * (ids.shape[1] + NEW)
    cache = HostOffloadedCache(config=cfg, max_cache_len=length)
    generate(model, ids, cache, gen())
    cache.crop(-(ids.shape[1] + NEW + 20))
    assert [int(layer.get_seq_length()) for layer in cache.layers] == [0] * cfg.num_hidden_layers
    assert cache.get_seq_length() == 0 and cache.bytes_per_step()[0] == 0
    with torch.no_grad():
        got = model(ids, past_key_values=cache, use_cache=True).logits
        want = model(ids, past_key_values=StaticCache(config=cfg, max_cache_len=length), use_cache=True).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("max_length", ["-3", 1.5, True, None, torch.tensor(-3)])
def test_a_crop_by_something_not_an_integer_is_a_value_error(max_length):
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    cache = HostOffloadedCache(config=cfg, max_cache_len=4 * ids.shape[1])
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="crop: max_length must be an integer"):
        cache.crop(max_length)
    assert cache.get_seq_length() == ids.shape[1]  # nothing was cropped


def test_a_crop_between_a_load_ahead_and_its_step_keeps_the_positions_written_again():
    # The layers loaded ahead (by the step before the crop) have all their positions on the host;
    # a crop then gives two of them up, and the next steps write those positions again: they must
    # reach the host when the slots are taken, or the steps after read the cropped values back.
    if not hasattr(transformers.cache_utils.StaticLayer, "crop"):
        pytest.skip(f"transformers {transformers.__version__}'s static layers cannot be cropped")
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    length = 4 * (ids.shape[1] + NEW)
    caches = (
        StaticCache(config=cfg, max_cache_len=length),
        HostOffloadedCache(config=cfg, max_cache_len=length, load_ahead=True),
    )
    tokens = torch.randint(1, cfg.vocab_size, (ids.shape[0], 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for c in caches:
            model(ids, past_key_values=c, use_cache=True)
        for i in range(6):
            if i == 3:
                for c in caches:
                    c.crop(-2)
            want, got = (model(tokens[:, i : i + 1], past_key_values=c, use_cache=True).logits for c in caches)
            assert torch.equal(got, want), i


def test_a_model_where_the_config_goes_is_refused_with_a_hint():
    model = model_of(llama(), LlamaForCausalLM)
    with pytest.raises(
        TypeError, match="config must be a transformers configuration, got LlamaForCausalLM; pass model.config"
    ):
        HostOffloadedCache(config=model, max_cache_len=32)
    with pytest.raises(TypeError, match="got dict$"):
        HostOffloadedCache(config={"num_hidden_layers": 2}, max_cache_len=32)


def test_a_model_with_no_full_attention_layer_streams_nothing_and_gives_the_static_caches_tokens():
    # Mistral with a sliding window: every layer windowed, as transformers' own offloading
    # leaves it, so the cache is a StaticCache (tokens past the window, beam search, a copy).
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, max_position_embeddings=256,
    )  # fmt: skip
    model, ids = model_of(cfg, MistralForCausalLM), prompt(cfg.vocab_size)
    want = generate(model, ids, StaticCache(config=cfg, max_cache_len=4 * (ids.shape[1] + NEW)), gen())
    cache = HostOffloadedCache(config=cfg, max_cache_len=4 * (ids.shape[1] + NEW))
    assert same(want, generate(model, ids, cache, gen()))
    assert cache.bytes_per_step() == (0, 0) and cache.gpu_bytes() == 0 and cache.resident() == []
    beams = dict(num_beams=2, num_return_sequences=1, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, past_key_values=StaticCache(config=cfg, max_cache_len=32), **beams)
        got = model.generate(ids, past_key_values=HostOffloadedCache(config=cfg, max_cache_len=32), **beams)
    assert torch.equal(want, got)


def test_a_layer_type_it_cannot_serve_is_refused():
    cfg = llama()
    cfg.layer_types = ["full_attention", "linear_attention"] + ["full_attention"] * (cfg.num_hidden_layers - 2)
    with pytest.raises(ValueError, match=r"has layers of type \['linear_attention'\]"):
        HostOffloadedCache(config=cfg, max_cache_len=32)


def test_a_batch_over_max_batch_size_is_refused_before_anything_is_allocated():
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size, batch=3)
    cache = HostOffloadedCache(config=cfg, max_cache_len=32, max_batch_size=2)
    with pytest.raises(ValueError, match="a batch of 3 is over max_batch_size 2"):
        generate(model, ids, cache, gen())
    assert cache.loads.slots == [] and cache.loads.host == {}


def test_a_prompt_or_a_step_past_max_cache_len_is_refused():
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size, length=9)
    with pytest.raises(ValueError, match="0 tokens cached and 9 more would pass max_cache_len 8"):
        generate(model, ids, HostOffloadedCache(config=cfg, max_cache_len=8), gen())
    cache = HostOffloadedCache(config=cfg, max_cache_len=11)  # room for two of the six new tokens
    with pytest.raises(ValueError, match="11 tokens cached and 1 more would pass max_cache_len 11"):
        generate(model, ids, cache, gen())


@pytest.mark.parametrize(("batch", "dtype"), [(3, torch.float32), (1, torch.float32), (2, torch.float64)])
def test_a_reset_cache_reused_at_another_batch_or_dtype_is_refused_before_it_writes(batch, dtype):
    cfg = llama()
    cache = HostOffloadedCache(config=cfg, max_cache_len=32)
    generate(model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size, batch=2), cache, gen())
    cache.reset()
    slots = [t.clone() for pair in cache.loads.slots for t in pair]
    model = model_of(cfg, LlamaForCausalLM, dtype=dtype)
    with pytest.raises(
        ValueError, match=rf"allocated for keys of batch 2, .* but got keys \({batch}, 2, 9, 16\) of {dtype}"
    ):
        generate(model, prompt(cfg.vocab_size, batch=batch), cache, gen())
    assert all(torch.equal(a, b) for a, b in zip(slots, (t for pair in cache.loads.slots for t in pair)))
    assert all(int(cache.layers[i].cumulative_length) == 0 for i in cache.offloaded)


def test_a_closed_cache_is_refused_before_any_layer_writes():
    cfg, cls = gemma3(), Gemma3ForCausalLM  # a sliding-window layer first: it must not write either
    model, ids = model_of(cfg, cls), prompt(cfg.vocab_size)
    cache = HostOffloadedCache(config=cfg, max_cache_len=32)
    generate(model, ids, cache, gen())
    cache.reset()
    cache.close()
    cache.close()  # twice: harmless

    def held():  # the slots, and the sliding-window layers' keys
        windowed = [layer.keys for i, layer in enumerate(cache.layers) if i not in cache.offloaded]
        return [t.clone() for pair in cache.loads.slots for t in pair] + [k.clone() for k in windowed]

    before = held()
    with pytest.raises(ValueError, match=rf"HostOffloadedCache: '{cache.name}' was closed"):
        generate(model, ids, cache, gen())
    assert all(torch.equal(a, b) for a, b in zip(held(), before, strict=True))


def test_keys_on_another_device_than_the_caches_are_refused():
    cfg = llama()
    model, ids = model_of(cfg, LlamaForCausalLM), prompt(cfg.vocab_size)
    cache = HostOffloadedCache(config=cfg, max_cache_len=32, device="meta")
    with pytest.raises(ValueError, match="the model's keys are on cpu, but the cache was made for meta"):
        generate(model, ids, cache, gen())


def test_a_cuda_cache_on_a_machine_without_cuda_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="HostOffloadedCache: device is 'cuda', but this machine has no CUDA device"):
        HostOffloadedCache(config=llama(), max_cache_len=32, device="cuda")


# --- on the GPU ------------------------------------------------------------------------------------


def cuda_run(cfg, cls, compile_config=None, before_decode=None, capacity=4, **cache_args):
    model = model_of(cfg, cls, "cuda", torch.bfloat16)
    ids = prompt(cfg.vocab_size, batch=2, length=33, device="cuda")
    length = capacity * (ids.shape[1] + NEW)
    want = generate(model, ids, StaticCache(config=cfg, max_cache_len=length), gen(compile_config))
    cache = HostOffloadedCache(config=cfg, max_cache_len=length, **cache_args)
    if before_decode is not None:
        before_decode(cache, model, ids)
    return generate(model, ids, cache, gen(compile_config)), want, cache


@gpu
@pytest.mark.parametrize(("name", "cfg", "cls"), list(models()), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("ahead", [False, True])
def test_on_a_gpu_eager_generate_is_bitwise_the_static_caches(name, cfg, cls, ahead):
    got, want, cache = cuda_run(cfg, cls, load_ahead=ahead)
    assert same(got, want)
    assert all(k.is_pinned() and v.is_pinned() for k, v in cache.loads.host.values())


@gpu
@pytest.mark.parametrize("skew", [0, 1, 3])
def test_on_a_gpu_an_eager_load_moves_the_positions_below_the_known_ones_by_the_copy_engine(skew, monkeypatch):
    # An eager step's load of a layer copies the positions the host counted (every streamed
    # layer's host copy holds them) with the copy engine and the rest with the kernel. A count
    # that falls short (skew; the host's own is exact) moves the difference with the kernel: the
    # tokens are the static cache's either way, and the copy engines' part ran at every decode step.
    calls = []
    load = SlotEngines.load

    def short(self, k, known, launch):
        calls.append(known)
        load(self, k, max(0, known - skew), launch)

    monkeypatch.setattr(SlotEngines, "load", short)
    monkeypatch.setattr(slot_engines, "FROM_BYTES", 0)  # these loads are far smaller than the default
    got, want, cache = cuda_run(llama(), LlamaForCausalLM)
    assert same(got, want)
    streamed = len(cache.loads.plan.streamed)
    # Each decode step loads every streamed layer, the prompt's 33 positions and one more per step.
    assert sorted(set(calls)) == list(range(33, 33 + NEW - 1)) and len(calls) == streamed * (NEW - 1)
    # Llama's keys and values agree in shape: each load's copy-engine part is one copy of both,
    # from and into memory where they lie back to back, each a storage of its own.
    assert [len(copies) for copies in cache.loads.engines.copies.values()] == [1] * streamed
    keys, values = cache.loads.slots[0]
    assert keys.untyped_storage().data_ptr() != values.untyped_storage().data_ptr()


@gpu
@pytest.mark.parametrize("from_positions", [36, None], ids=["from-36-positions", "default"])
def test_on_a_gpu_the_copy_engine_takes_an_eager_load_from_its_bytes_threshold_on(from_positions, monkeypatch):
    # Below FROM_BYTES a layer's known positions are the kernel's (SlotEngines.load is not
    # called); from it on, the copy engine's. The default (16 MiB) is far above these loads.
    cfg = llama()
    position = 2 * cfg.num_key_value_heads * 2 * cfg.head_dim * 2  # batch 2, keys and values, bf16
    if from_positions is not None:
        monkeypatch.setattr(slot_engines, "FROM_BYTES", from_positions * position)
    calls = []
    load = SlotEngines.load

    def counted(self, k, known, launch):
        calls.append(known)
        load(self, k, known, launch)

    monkeypatch.setattr(SlotEngines, "load", counted)
    got, want, cache = cuda_run(cfg, LlamaForCausalLM)
    assert same(got, want) and cache.loads.position_bytes == position
    first = 33 + NEW - 1 if from_positions is None else from_positions  # the prompt: 33 positions
    streamed = len(cache.loads.plan.streamed)
    assert calls == [known for known in range(first, 33 + NEW - 1) for _ in range(streamed)]


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_on_a_gpu_a_model_on_another_device_than_the_current_one_is_bitwise_the_static_caches():
    # The slots, streams, events and launches must all be cuda:1's while cuda:0 is current.
    cfg = llama()
    model = model_of(cfg, LlamaForCausalLM, "cuda:1", torch.bfloat16)
    ids = prompt(cfg.vocab_size, batch=2, length=33, device="cuda:1")
    torch.cuda.set_device(0)
    want = generate(model, ids, StaticCache(config=cfg, max_cache_len=160), gen())
    cache = HostOffloadedCache(config=cfg, max_cache_len=160)
    assert same(generate(model, ids, cache, gen()), want)
    assert cache.loads.slots[0][0].device == torch.device("cuda:1") and torch.cuda.current_device() == 0


@gpu
@pytest.mark.parametrize(("name", "cfg", "cls"), list(models())[:2], ids=lambda v: v if isinstance(v, str) else "")
def test_on_a_gpu_a_capture_of_the_first_step_is_refused_and_the_cache_then_serves(name, cfg, cls):
    # The first step allocates: page-locked host copies, the loads' own graphs, counts copied to
    # the GPU. A CUDA graph records none of it, so the first layer's update refuses (Gemma 3's is
    # a sliding-window layer), and the cache, still unallocated, serves the eager run after.
    def capture_first(cache, model, ids):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="a CUDA graph cannot capture the first step"), torch.no_grad():
            with torch.cuda.graph(graph):
                model(ids, past_key_values=cache, use_cache=True)
        assert cache.loads.plan is None and not any(getattr(layer, "is_initialized", False) for layer in cache.layers)

    got, want, _ = cuda_run(cfg, cls, before_decode=capture_first)
    assert same(got, want)


@gpu
def test_on_a_gpu_a_delayed_load_is_waited_for():
    # The load stream sleeps 50 ms before the first prefetch: the layer that reads the slot must wait.
    def delay(cache, model, ids):
        with torch.no_grad():
            model(ids[:, :1], past_key_values=cache, use_cache=True)  # allocates, loads nothing yet
        cache.reset()
        with torch.cuda.stream(cache.loads.stream):
            torch.cuda._sleep(100_000_000)

    got, want, _ = cuda_run(llama(), LlamaForCausalLM, before_decode=delay)
    assert same(got, want)


@gpu
@pytest.mark.parametrize(("ahead", "attention"), [(True, "sdpa"), (False, "sdpa"), (False, "sdpa, math kernels")])
def test_on_a_gpu_generate_with_cuda_graphs_gives_the_static_caches_tokens(ahead, attention):
    # SDPA's math kernels: what racecheck's runs attend with (tests/gpu_marker.py), and what runs
    # where the fused kernels are unavailable or switched off. The backend is chosen as the step
    # is traced, and Dynamo does not guard on it: the math case traces afresh.
    config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    math = "math" in attention
    if math:
        torch._dynamo.reset()
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    with sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext():
        got, want, cache = cuda_run(llama(), LlamaForCausalLM, compile_config=config, load_ahead=ahead)
    assert torch.equal(got.sequences, want.sequences)
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips  # the step was captured
    torch.cuda.synchronize()
    assert (held_after_the_step(cache) == list(cache.loads.plan.issues[0])) == ahead  # it loaded ahead


def prefilled_with_a_sleeping_load_stream() -> HostOffloadedCache:
    """A cache with load_ahead after a prefill on the GPU, its load stream then put to sleep
    (about 50 ms): what is queued there next lands late."""
    cfg = llama()
    model = model_of(cfg, LlamaForCausalLM, "cuda", torch.bfloat16)
    ids = prompt(cfg.vocab_size, batch=2, length=33, device="cuda")
    cache = HostOffloadedCache(config=cfg, max_cache_len=4 * (ids.shape[1] + NEW), load_ahead=True)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(cache.loads.stream):
        torch.cuda._sleep(100_000_000)
    return cache


@gpu
@pytest.mark.parametrize("ahead", [True, False])
def test_on_a_gpu_the_current_stream_waits_for_the_loads_ahead(ahead):
    # A step replayed from a CUDA graph orders its reads after its own nodes only, so the loads
    # queued ahead must hold back the current stream itself, at the next step's first layer. The
    # load stream sleeps first: work queued on the current stream after the join must not finish
    # before it wakes.
    cache = prefilled_with_a_sleeping_load_stream()
    slept, after = torch.cuda.Event(), torch.cuda.Event()
    slept.record(cache.loads.stream)
    if ahead:
        for k in cache.loads.plan.issues[0]:
            cache.loads.queue_ahead(k)
    cache.loads.join_ahead()
    after.record()
    after.synchronize()
    assert slept.query() == ahead  # with nothing queued ahead the join waits for nothing (the control)
    torch.cuda.synchronize()


@gpu
def test_on_a_gpu_a_cache_dropped_with_loads_ahead_under_way_waits_for_them_before_its_memory_goes():
    # The last step's loads ahead still write the slots and host copies when the cache is
    # dropped: its memory must not go back (to the allocator, or unpinned) before they end.
    import gc

    cache = prefilled_with_a_sleeping_load_stream()
    stream = cache.loads.stream
    for k in cache.loads.plan.issues[0]:
        cache.loads.queue_ahead(k)
    assert not stream.query()  # the control: the loads are still under way
    del cache
    gc.collect()
    assert stream.query()  # dropping the cache waited for them


@gpu
@pytest.mark.parametrize("mode", ["eager", "reduce-overhead"])
def test_on_a_gpu_loads_ahead_that_land_late_are_waited_for(mode):
    # The load stream sleeps before every load queued ahead, so each lands long after the step
    # that queued it has ended: the next step, eager or replayed from CUDA graphs, must wait for
    # it before its first layers read their slots (or the tokens differ).
    config = None if mode == "eager" else CompileConfig(fullgraph=True, mode=mode)
    delayed = []

    def delay(cache, model, ids):
        queue_ahead = cache.loads.queue_ahead

        def late(k, tensors=None):
            with torch.cuda.stream(cache.loads.stream):
                torch.cuda._sleep(20_000_000)
            queue_ahead(k, tensors)
            delayed.append(k)

        with torch.no_grad():
            model(ids[:, :1], past_key_values=cache, use_cache=True)  # allocates the loads
        cache.reset()
        cache.loads.queue_ahead = late

    got, want, cache = cuda_run(llama(), LlamaForCausalLM, compile_config=config, before_decode=delay, load_ahead=True)
    assert same(got, want)
    assert len(delayed) == NEW * len(cache.loads.plan.issues[0])  # every step queued its loads ahead


@gpu
def test_on_a_gpu_a_new_cache_per_request_under_cuda_graphs_gives_the_static_caches_tokens():
    # Each request's cache takes the dropped one's name and compiled step; its slots may land where
    # the last one's were, its host copies elsewhere: the step's recording must never replay with
    # another cache's host addresses (they are the step's inputs, so the trees record again).
    cfg = llama()
    model = model_of(cfg, LlamaForCausalLM, "cuda", torch.bfloat16)
    config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    kept = None  # the last cache's host copies, alive: the next cache's cannot land where they are
    names = []
    for seed in range(3):
        ids = torch.randint(1, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(seed)).cuda()
        length = 4 * (ids.shape[1] + NEW)
        want = generate(model, ids, StaticCache(config=cfg, max_cache_len=length), gen(config))
        ballast = torch.empty(
            int(torch.randint(1, 64, (1,))) << 20, dtype=torch.uint8, device="cuda"
        )  # moves the slots
        cache = HostOffloadedCache(config=cfg, max_cache_len=length)
        got = generate(model, ids, cache, gen(config))
        names.append(cache.name)
        assert names[seed] == names[0]  # the dropped cache's
        assert torch.equal(got.sequences, want.sequences), seed
        if kept is not None:  # a replay of the last recording would have read those host copies
            assert all(kept[k][0].data_ptr() != cache.loads.host[k][0].data_ptr() for k in kept)
        kept = cache.loads.host
        del cache, got, ballast


@gpu
@pytest.mark.parametrize(("held", "resident"), [(4, 2), (2, 1)])  # two shared slots; one
def test_on_a_gpu_a_budget_gives_the_static_caches_tokens(held, resident):
    cfg = llama(layers=8)
    layer = 2 * 2 * cfg.num_key_value_heads * cfg.head_dim * 2 * 4 * (33 + NEW)  # K and V, batch 2, bf16
    got, want, cache = cuda_run(cfg, LlamaForCausalLM, max_gpu_bytes=held * layer)
    assert same(got, want)
    assert len(cache.resident()) == resident and cache.gpu_bytes() == held * layer


@gpu
def test_on_a_gpu_beam_search_is_bitwise_the_static_caches():
    # The slots are reordered on the GPU, the host copies on the host once the step's loads are done.
    cfg = llama(layers=8)
    model = model_of(cfg, LlamaForCausalLM, "cuda", torch.bfloat16)
    ids = prompt(cfg.vocab_size, batch=2, length=33, device="cuda")
    length = 4 * (ids.shape[1] + NEW)
    want = generate(model, ids, StaticCache(config=cfg, max_cache_len=length), beams(3))
    cache = HostOffloadedCache(config=cfg, max_cache_len=length)
    got = generate(model, ids, cache, beams(3))
    assert same_beams(got, want)
    assert len(cache.loads.plan.streamed) == 7


@gpu
def test_on_a_gpu_prefix_caching_by_deepcopy_is_bitwise_the_static_caches():
    # The copy's slots are filled on the GPU, its host copies on the host once the loads are done.
    cfg = llama(layers=8)
    model, length = model_of(cfg, LlamaForCausalLM, "cuda", torch.bfloat16), 4 * (9 + 5 + NEW)
    want, _ = prefix_cached(model, cfg, StaticCache(config=cfg, max_cache_len=length), "cuda")
    got, caches = prefix_cached(model, cfg, HostOffloadedCache(config=cfg, max_cache_len=length), "cuda")
    assert all(same(a, b) for a, b in zip(got, want, strict=True))
    assert all(len(c.loads.plan.streamed) == 7 and k.is_pinned() for c in caches for k, _ in c.loads.host.values())


@gpu
@pytest.mark.parametrize("ahead", [False, True])
def test_on_a_gpu_a_captured_decode_step_replays_the_loads(ahead):
    # A decode step of the model captured by hand in a torch.cuda.CUDAGraph and replayed per token,
    # while the sequence grows across a tile of the load kernel (bf16, dim 16: 32 B a position).
    # With load_ahead the capture stops the loads ahead (its replays would not wait for them).
    cfg = llama()
    model = model_of(cfg, LlamaForCausalLM, "cuda", torch.bfloat16)
    boundary = TILE_BYTES // (cfg.head_dim * 2)
    ids = prompt(cfg.vocab_size, batch=2, length=boundary - NEW // 2, device="cuda")
    length = 4 * (ids.shape[1] + NEW)

    def decode(cache, graphed: bool):
        tokens = []
        with torch.no_grad():
            logits = model(ids, past_key_values=cache, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            static = token.clone()
            position = torch.tensor([[ids.shape[1]]], device="cuda").expand(2, 1).contiguous()

            def step():
                return model(static, past_key_values=cache, position_ids=position, use_cache=True).logits

            graph = None
            for _ in range(NEW):
                static.copy_(token)
                if graphed and graph is None:
                    # Warm up on a side stream, then capture; both advance the cache, so rewind it.
                    snapshot = [layer.cumulative_length.clone() for layer in cache.layers]
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        step()
                    torch.cuda.current_stream().wait_stream(side)
                    for layer, value in zip(cache.layers, snapshot):
                        layer.cumulative_length.copy_(value)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        out = step()
                    for layer, value in zip(cache.layers, snapshot):
                        layer.cumulative_length.copy_(value)
                if graphed:
                    graph.replay()
                    logits = out
                else:
                    logits = step()
                token = logits[:, -1:].argmax(-1)
                tokens.append(token)
                position.add_(1)
        return torch.cat(tokens, 1)

    want = decode(StaticCache(config=cfg, max_cache_len=length), graphed=False)
    cache = HostOffloadedCache(config=cfg, max_cache_len=length + 1, load_ahead=ahead)  # + the warm-up
    assert torch.equal(decode(cache, graphed=True), want)
    assert cache.loads.ahead_stopped == ahead
