"""The decode loop's model: a small Gemma-3n-style decoder over a paged KV cache, its per-layer
embedding served off the GPU, and ``decode_step``, the function the loop compiles.

``decode_step`` and ``make_model`` live at module level in a module of their own so that the
other processes can import them by name: the offload process unpickles ``make_model`` (spawn),
and the process that loads the AOT artifact calls the step of the same module
(``kv_ops.tools.aot``: the model is the step's first argument).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import kv_ops
import ple_ops

# The LayerwiseLoads every layer's wait_layer names. The graph carries only this string, so each
# process (the AOT-loading one too) makes its own instance of this name before it runs the step.
LOADS = "decode_loop.resume"
# The StepTransfers whose staged stores and loads the step runs first (the same rule for the name).
TRANSFERS = "decode_loop.step"


@dataclass(frozen=True)
class Config:
    """Model widths and the workload: ``batch`` sequences decoded together, each with a prompt of
    ``prompt`` tokens and ``total`` tokens in the end (both drawn from the closed ranges)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    ple_dim: int
    batch: int
    prompt: tuple[int, int]
    total: tuple[int, int]
    block_size: int = 16

    @property
    def max_blocks(self) -> int:
        """Blocks one sequence needs at most (its last token is sampled, never written)."""
        return math.ceil((self.total[1] - 1) / self.block_size)


CONFIGS = {
    # CI's CPU: seconds per compile, under two minutes in all.
    "small": Config(
        vocab=512,
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        mlp=128,
        ple_dim=16,
        batch=4,
        prompt=(3, 9),
        total=(40, 60),
    ),
    # The "realistic widths": Gemma-3n E2B's hidden, MLP and PLE sizes, 8 layers, 8 sequences.
    "gemma": Config(
        vocab=32768,
        hidden=2048,
        layers=8,
        heads=16,
        kv_heads=8,
        head_dim=128,
        mlp=8192,
        ple_dim=256,
        batch=8,
        prompt=(8, 32),
        total=(160, 256),
    ),
}


def _weight(seed: int, *shape: int, scale: float) -> nn.Parameter:
    # One generator per tensor: both processes of the process transport, and the placeholder
    # build that skips the PLE table, get the same weights whatever else they built before.
    gen = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(*shape, generator=gen) * scale, requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, seed: int):
        super().__init__()
        self.weight = _weight(seed, dim, scale=0.1)
        with torch.no_grad():
            self.weight.add_(1.0)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Linear(nn.Module):
    def __init__(self, fan_in: int, fan_out: int, seed: int):
        super().__init__()
        self.weight = _weight(seed, fan_out, fan_in, scale=fan_in**-0.5)

    def forward(self, x):
        return F.linear(x, self.weight)


class PerLayerEmbedding(ple_ops.PleOffloadLayer):
    """Gemma-3n's per-layer embedding: rows ``[n, layers x ple_dim]`` of one table, a pure lookup."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.table = _weight(7, cfg.vocab, cfg.layers * cfg.ple_dim, scale=1.0)

    def forward_impl(self, input_ids):
        return self.table[input_ids.to(self.table.device)]

    def lookup_table(self):
        return self.table


class Slots(NamedTuple):
    """Where each batch row's token sits in the paged KV cache (all int64, one row per slot)."""

    positions: torch.Tensor  # [B] position of the token in its sequence
    seq_lens: torch.Tensor  # [B] tokens visible to attention, this one included
    block_table: torch.Tensor  # [B, max_blocks] GPU block of each logical block
    slot_block: torch.Tensor  # [B] block this token's K and V are written to
    slot_offset: torch.Tensor  # [B] row within that block


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[B, heads, head_dim]`` at ``positions`` ``[B]``."""
    half = x.shape[-1] // 2
    inv_freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = positions[:, None].to(torch.float32) * inv_freq
    cos, sin = angle.cos()[:, None, :].to(x.dtype), angle.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    """Grouped-query attention over a paged KV cache ``[2, num_blocks, block_size, kv_heads, head_dim]``."""

    def __init__(self, cfg: Config, seed: int):
        super().__init__()
        self.cfg = cfg
        self.q = Linear(cfg.hidden, cfg.heads * cfg.head_dim, seed)
        self.k = Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, seed + 1)
        self.v = Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, seed + 2)
        self.o = Linear(cfg.heads * cfg.head_dim, cfg.hidden, seed + 3)

    def forward(self, x, slots: Slots):
        cfg, batch = self.cfg, x.shape[0]
        q = rotate(self.q(x).view(batch, cfg.heads, cfg.head_dim), slots.positions)
        k = rotate(self.k(x).view(batch, cfg.kv_heads, cfg.head_dim), slots.positions)
        v = self.v(x).view(batch, cfg.kv_heads, cfg.head_dim)
        # This token's K and V go into its slot first, so that it attends to itself below.
        self.kv_cache[:, slots.slot_block, slots.slot_offset] = torch.stack([k, v])
        keys = self.kv_cache[0][slots.block_table].flatten(1, 2)  # [B, max_blocks * block_size, kv_heads, D]
        values = self.kv_cache[1][slots.block_table].flatten(1, 2)
        q = q.view(batch, cfg.kv_heads, cfg.heads // cfg.kv_heads, cfg.head_dim)
        scores = torch.einsum("bhgd,bthd->bhgt", q, keys) * cfg.head_dim**-0.5
        # Masked positions get exactly zero weight, so whatever finite bytes sit in blocks a row
        # does not own (other sequences', the null block) cannot change its result by one bit.
        visible = torch.arange(keys.shape[1], device=x.device)[None, :] < slots.seq_lens[:, None]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        out = torch.einsum("bhgt,bthd->bhgd", scores.softmax(dim=-1), values)
        return self.o(out.reshape(batch, cfg.heads * cfg.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, index: int):
        super().__init__()
        self.index = index
        seed = 1000 * (index + 1)
        self.attn_norm = RMSNorm(cfg.hidden, seed)
        self.attn = Attention(cfg, seed + 10)
        self.mlp_norm = RMSNorm(cfg.hidden, seed + 20)
        self.gate = Linear(cfg.hidden, cfg.mlp, seed + 21)
        self.up = Linear(cfg.hidden, cfg.mlp, seed + 22)
        self.down = Linear(cfg.mlp, cfg.hidden, seed + 23)
        self.ple_gate = Linear(cfg.hidden, cfg.ple_dim, seed + 30)
        self.ple_proj = Linear(cfg.ple_dim, cfg.hidden, seed + 31)
        self.ple_norm = RMSNorm(cfg.hidden, seed + 32)

    def forward(self, h, slots: Slots):
        # Before the attention writes this token's K and V into its cache and reads the blocks:
        # the stream waits until this layer's blocks of a resumed sequence have landed (layer
        # i+1's may still be on the way). It takes h, the previous layer's output, so that the
        # compiler cannot hoist it above that layer, and declares the cache mutated, so that no
        # read or write of the cache moves above it. With no load started it waits on completed
        # events (on the CPU it only counts: the engine copied at start).
        h = kv_ops.wait_layer(h, LOADS, self.index, [self.attn.kv_cache])
        h = h + self.attn(self.attn_norm(h), slots)
        x = self.mlp_norm(h)
        return h + self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))

    def add_per_layer(self, h, rows):
        """Gemma-3n's per-layer input: this layer's embedding rows ``[B, ple_dim]``, gated by the
        hidden state, projected back and added."""
        gated = F.gelu(self.ple_gate(h), approximate="tanh") * rows
        return h + self.ple_norm(self.ple_proj(gated))


class DecoderLM(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = _weight(1, cfg.vocab, cfg.hidden, scale=1.0)
        self.per_layer = PerLayerEmbedding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, 2)
        self.lm_head = Linear(cfg.hidden, cfg.vocab, 3)

    def attach_kv_cache(self, num_blocks: int, device: torch.device, shared=None) -> dict[str, torch.Tensor]:
        """Give every layer a zeroed cache (finite bytes everywhere), or another model's caches
        (``shared``, as returned here), used in turn; returns them by layer name."""
        cfg = self.cfg
        caches = {}
        for i, layer in enumerate(self.layers):
            if shared is None:
                cache = torch.zeros(2, num_blocks, cfg.block_size, cfg.kv_heads, cfg.head_dim, device=device)
            else:
                cache = shared[f"layers.{i}"]
            layer.attn.register_buffer("kv_cache", cache, persistent=False)
            caches[f"layers.{i}"] = cache
        return caches

    def forward(self, tokens, slots: Slots):
        cfg = self.cfg
        h = self.embed[tokens]
        rows = None
        for i, layer in enumerate(self.layers):
            h = layer(h, slots)
            if rows is None:
                # Asked for after layer 0's attention and MLP (they are the op's dependency), so
                # the offload process computes the rows while the GPU runs them.
                rows = self.per_layer(h, tokens).view(-1, cfg.layers, cfg.ple_dim)
            h = layer.add_per_layer(h, rows[:, i])
        return self.lm_head(self.norm(h))

    def release_offloaded(self) -> None:
        self.per_layer.release_offloaded()


def make_model(cfg: Config) -> DecoderLM:
    """The model factory both processes of the process transport call (module level: picklable)."""
    return DecoderLM(cfg).eval()


def decode_step(model: DecoderLM, tokens, positions, seq_lens, block_table, slot_block, slot_offset):
    """One decode step of every batch row: logits and the greedy next tokens. The model is the
    first argument (the AOT recipe, kv_ops.tools.aot), and the graph holds the PLE flag resets.
    First the step stores the blocks of the sequences preempted for it and loads those of the
    sequences it resumes, as staged (nothing when nothing is)."""
    kv_ops.step_transfers(TRANSFERS, [layer.attn.kv_cache for layer in model.layers])
    logits = model(tokens, Slots(positions, seq_lens, block_table, slot_block, slot_offset))
    model.release_offloaded()
    return logits, logits.argmax(dim=-1)
