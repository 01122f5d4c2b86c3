"""The paged key/value cache: block counts (sharing, freeing, growth) and attention over the written positions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.engines.local.paged import SCRATCH, BlockPool, PagedKV, blocks_needed, paged_attention

HEADS, KV_HEADS, DIM = 4, 2, 8


def _prompt_states(lengths: list[int], layers: int = 2, seed: int = 0):
    """Random key/value states of left-padded prompts `[P, kv_heads, width, D]` and each one's real columns."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    keys = [torch.randn(len(lengths), KV_HEADS, width, DIM, generator=gen) for _ in range(layers)]
    values = [torch.randn(len(lengths), KV_HEADS, width, DIM, generator=gen) for _ in range(layers)]
    columns = [torch.arange(width - n, width) for n in lengths]
    return keys, values, columns


def test_rows_of_one_prompt_share_its_full_blocks_and_free_them_when_they_leave():
    pool = BlockPool(layers=2, blocks=32, block_size=4)
    cache = PagedKV(pool)
    keys, values, columns = _prompt_states([10, 3])
    cache.add_rows(keys, values, columns, source=[0, 0, 0, 1])
    # prompt 0: 2 full blocks shared by its 3 rows + a 2-token block each; prompt 1: one 3-token block
    assert pool.used_blocks == 2 + 3 + 1
    shared = cache.tables[0][:2]
    assert cache.tables[1][:2] == shared and cache.tables[2][:2] == shared
    assert [pool.refs[b] for b in shared] == [3, 3]
    assert cache.lengths == [10, 10, 10, 3]
    cache.batch_select_indices(torch.tensor([2, 3]))  # rows 0 and 1 finish: their own blocks go back
    assert pool.used_blocks == 2 + 1 + 1 and [pool.refs[b] for b in shared] == [1, 1]
    cache.batch_select_indices([1])
    assert pool.used_blocks == 1  # the last of the shared ones went with row 2
    cache.release_all()
    assert pool.used_blocks == 0 and len(pool.free) == pool.capacity - 1 and pool.refs[SCRATCH] == 1


def test_written_states_read_back_per_row():
    pool = BlockPool(layers=2, blocks=16, block_size=4)
    cache = PagedKV(pool)
    keys, values, columns = _prompt_states([10, 3])
    cache.add_rows(keys, values, columns, source=[0, 1, 0])
    for row, prompt in enumerate([0, 1, 0]):
        slots = torch.tensor([cache.tables[row][i // 4] * 4 + i % 4 for i in range(cache.lengths[row])])
        for layer in range(2):
            assert torch.equal(pool.keys[layer][0][:, slots], keys[layer][prompt][:, columns[prompt]])
            assert torch.equal(pool.values[layer][0][:, slots], values[layer][prompt][:, columns[prompt]])


def test_a_full_pool_grows_and_keeps_its_contents():
    pool = BlockPool(layers=1, blocks=3, block_size=2)
    cache = PagedKV(pool)
    keys, values, columns = _prompt_states([4], layers=1)
    cache.add_rows(keys, values, columns, source=[0])
    before = pool.keys[0].clone()
    cache.add_rows(keys, values, columns, source=[0])  # a second prompt of 2 blocks: past the capacity
    assert pool.generation == 1 and pool.capacity == 6 and pool.used_blocks == 4
    assert torch.equal(pool.keys[0][:, :, : before.shape[2]], before)


def test_blocks_needed_counts_shared_blocks_once():
    # 10 tokens in blocks of 4: 2 shared + per row ceil((2 + 5) / 4) = 2; 3 tokens: per row ceil(8 / 4) = 2
    assert blocks_needed([10, 3], copies=3, max_tokens=5, block_size=4) == 1 + (2 + 3 * 2) + (0 + 3 * 2)


@pytest.mark.parametrize("backend", ["gather", "flex"])
def test_attention_over_written_positions_matches_dense_attention(backend):
    pool = BlockPool(layers=1, blocks=24, block_size=4)
    cache = PagedKV(pool, backend)
    keys, values, columns = _prompt_states([10, 3, 7], layers=1, seed=1)
    cache.add_rows(keys, values, columns, source=[0, 1, 0, 2])
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(4, HEADS, 1, DIM, generator=gen)
    new_k, new_v = torch.randn(4, KV_HEADS, 1, DIM, generator=gen), torch.randn(4, KV_HEADS, 1, DIM, generator=gen)
    cache.update(new_k, new_v, 0)
    out = cache.attend(q, 0, 0.3)
    for row, prompt in enumerate([0, 1, 0, 2]):
        k = torch.cat([keys[0][prompt][:, columns[prompt]], new_k[row]], dim=1)[None]
        v = torch.cat([values[0][prompt][:, columns[prompt]], new_v[row]], dim=1)[None]
        ref = F.scaled_dot_product_attention(q[row : row + 1], k, v, scale=0.3, enable_gqa=True)
        assert torch.allclose(out[row, 0], ref.transpose(1, 2).reshape(-1), atol=1e-6)
    cache.advance()
    assert cache.lengths == [11, 4, 11, 8]
    assert paged_attention(pool, 0, q, cache.step_meta(), 0.3, backend).shape == (4, 1, HEADS * DIM)


def test_bad_backend_is_refused():
    with pytest.raises(ValueError, match="'gather' or 'flex'"):
        PagedKV(BlockPool(1, 4), "dense")


@pytest.mark.slow
def test_compiled_flex_attention_matches_gather():
    """Compiled (inductor's CPU template; Triton on a GPU), FlexAttention visits only the rows' blocks: the
    same output as the gather path (about a minute of compiling, hence slow)."""
    pool = BlockPool(layers=1, blocks=24, block_size=4)
    cache = PagedKV(pool, "flex")
    keys, values, columns = _prompt_states([10, 3, 7], layers=1, seed=3)
    cache.add_rows(keys, values, columns, source=[0, 1, 0, 2])
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(4, HEADS, 1, DIM, generator=gen)
    cache.update(torch.randn(4, KV_HEADS, 1, DIM, generator=gen), torch.randn(4, KV_HEADS, 1, DIM, generator=gen), 0)
    flex_meta = cache._meta
    cache.backend = "gather"
    want = paged_attention(pool, 0, q, cache.step_meta(), 0.3, "gather")
    got = torch.compile(lambda q_: paged_attention(pool, 0, q_, flex_meta, 0.3, "flex"))(q)
    assert torch.allclose(got, want, atol=1e-6)
