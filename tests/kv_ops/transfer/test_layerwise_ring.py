"""The staged layer-wise copies' pure plan (kv_ops.transfer.layerwise_ring): a layer's regions as
pieces of a mirror row, and every (layer, chunk) of a start planned into ring slots, executed
here on host memory exactly as the copy engines would (the GPU run is test_layerwise's)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_ops.transfer import dma
from kv_ops.transfer.layerwise_ring import RUN_2D, SLOTS, Piece, id_blocks, layout, pieces, plan


def test_neighbouring_regions_of_a_layer_merge_into_one_piece_and_others_do_not():
    # K and V of a layer side by side in the mirror row: one piece; in the layer's order.
    assert pieces([64, 96], [32, 16]) == [Piece(64, 0, 48)]
    # Apart in the row (another layer's region between them): two pieces, packed in the slot row.
    assert pieces([0, 96], [32, 16]) == [Piece(0, 0, 32), Piece(96, 32, 16)]
    # Listed in the other order than the row's: no merge, the slot follows the layer's order.
    assert pieces([32, 0], [32, 32]) == [Piece(32, 0, 32), Piece(0, 32, 32)]


def run_plan(host, layer_widths, layer_columns, chunk, first_slot, rows=40):
    """Execute the plan on a random mirror of ``rows`` rows; return (ring, plans, layer_bytes, mirror)."""
    row = sum(sum(w) for w in layer_widths)
    rng = np.random.default_rng(0)
    mirror = rng.integers(0, 256, (rows, row), dtype=np.uint8)
    layer_bytes = [sum(w) for w in layer_widths]
    slot_bytes = chunk * max(layer_bytes)
    ring = np.zeros(SLOTS * slot_bytes, dtype=np.uint8)
    layer_pieces = [pieces(c, w) for c, w in zip(layer_columns, layer_widths)]
    plans = plan(
        np.asarray(host, dtype=np.int64),
        layout(layer_pieces, layer_bytes),
        chunk,
        mirror.ctypes.data,
        row,
        ring.ctypes.data,
        slot_bytes,
        first_slot,
    )
    return ring, plans, layer_bytes, mirror, slot_bytes


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 4),
    chunk=st.integers(1, 20),
    first_slot=st.integers(0, SLOTS - 1),
    split=st.booleans(),  # each layer's two regions apart in the row (two pieces) or side by side
    data=st.data(),
)
def test_every_pair_of_every_layer_lands_in_its_slot_row_once(layers, chunk, first_slot, split, data):
    widths = [[8, 4] for _ in range(layers)]
    if split:  # all K regions first, then all V regions: a layer's two are apart
        columns = [[8 * i, 8 * layers + 4 * i] for i in range(layers)]
    else:
        columns = [[12 * i, 12 * i + 8] for i in range(layers)]
    n = data.draw(st.integers(1, 40))
    if data.draw(st.booleans()):
        start = data.draw(st.integers(0, 40 - n))
        host = list(range(start, start + n))  # one run
    else:
        host = data.draw(st.lists(st.integers(0, 39), min_size=n, max_size=n))
    ring_rows = []
    ring, plans, layer_bytes, mirror, slot_bytes = run_plan(host, widths, columns, chunk, first_slot)
    chunks = -(-n // chunk)
    assert [(p.layer, p.start, p.stop) for p in plans] == [
        (layer, c * chunk, min(n, (c + 1) * chunk)) for layer in range(layers) for c in range(chunks)
    ]
    assert [p.slot for p in plans] == [(first_slot + k) % SLOTS for k in range(len(plans))]
    for p in plans:
        # The driver reads the descriptor arrays raw, from their first address on (run_on_host
        # would not notice a strided view): each must be contiguous int64.
        for a in (p.copies.dsts, p.copies.srcs, p.copies.sizes):
            assert a.dtype == np.int64 and a.flags.c_contiguous and a.size == p.copies.count
        ring[:] = 0
        dma.run_on_host(p.copies)
        for copy in p.strided:
            assert copy.height >= RUN_2D
            dma.run_2d_on_host(copy)
        lb = layer_bytes[p.layer]
        got = ring[p.slot * slot_bytes :][: (p.stop - p.start) * lb].reshape(-1, lb)
        want = np.concatenate(
            [mirror[host[p.start : p.stop], c : c + w] for c, w in zip(columns[p.layer], widths[p.layer])], axis=1
        )
        assert np.array_equal(got, want), p
        ring_rows.append(got.shape[0])
        # Nothing outside the chunk's rows of its slot was written.
        assert not ring[: p.slot * slot_bytes].any() and not ring[p.slot * slot_bytes + got.size :].any()
    assert sum(ring_rows) == layers * n


def test_a_run_of_host_ids_is_one_2d_copy_per_piece_and_short_runs_go_one_by_one():
    host = list(range(10, 10 + RUN_2D)) + [3, 4] + [30]  # a long run, a short one, a single id
    _, plans, layer_bytes, _, _ = run_plan(host, [[8, 4]], [[0, 8]], chunk=64, first_slot=0)
    (p,) = plans
    assert [(c.height, c.width, c.src_pitch, c.dst_pitch) for c in p.strided] == [(RUN_2D, 12, 12, 12)]
    assert p.copies.count == 3  # the short run's two pairs and the single one


def test_an_empty_start_plans_nothing():
    assert run_plan([], [[8, 4]], [[0, 8]], chunk=4, first_slot=2)[1] == []


@pytest.mark.parametrize("chunk", [RUN_2D, RUN_2D + 1, 2 * RUN_2D + 3])
def test_a_run_never_crosses_a_chunk(chunk):
    n = 3 * chunk + RUN_2D  # one run of host ids over four chunks
    _, plans, _, _, _ = run_plan(list(range(n)), [[4]], [[0]], chunk=chunk, first_slot=0, rows=n)
    assert [sum(c.height for c in p.strided) for p in plans] == [chunk, chunk, chunk, RUN_2D]
    assert all(p.copies.count == 0 for p in plans)


@pytest.mark.parametrize("n, chunk", [(1, 4), (4, 4), (9, 4), (12, 5), (3, 1)])
def test_a_starts_id_blocks_hold_each_chunks_count_and_gpu_ids(n, chunk):
    per = 1 + chunk
    words = np.full(-(-n // chunk) * per + 3, -7, dtype=np.int64)  # poisoned, and longer than needed
    gpu = np.random.default_rng(n).permutation(100)[:n].astype(np.int64)
    chunks = id_blocks(words, gpu, chunk)
    assert chunks == -(-n // chunk)
    for c in range(chunks):
        count = min(chunk, n - c * chunk)
        block = words[c * per : (c + 1) * per]
        assert block[0] == count
        assert block[1 : 1 + count].tolist() == gpu[c * chunk : c * chunk + count].tolist()
    assert (words[chunks * per :] == -7).all()  # nothing written past the last block
