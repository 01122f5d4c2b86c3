"""The packed-push layout that the sender and every receiver compute alike (`sync.group.pack_plan`)."""

from __future__ import annotations

import torch

from tokenmill.sync.group import bucket_length, pack_plan

F32, BF16 = torch.float32, torch.bfloat16


def test_pack_plan_aligns_each_tensor_and_starts_a_bucket_when_the_next_would_overflow():
    shapes, dtypes = [[3, 5], [7], [100, 100], [2]], [F32, BF16, F32, F32]
    # 60 B, 14 B, 40,000 B, 8 B; every tensor starts on a 64-byte boundary
    assert pack_plan(shapes, dtypes, 1 << 30) == [[(0, 0), (1, 64), (2, 128), (3, 40128)]]
    assert [bucket_length(b, shapes, dtypes) for b in pack_plan(shapes, dtypes, 1 << 30)] == [40136]
    # 1,000-byte buckets: the two small ones share one, the 40 KB tensor goes alone, then the last
    plan = pack_plan(shapes, dtypes, 1000)
    assert plan == [[(0, 0), (1, 64)], [(2, 0)], [(3, 0)]]
    assert [bucket_length(b, shapes, dtypes) for b in plan] == [78, 40000, 8]
    assert pack_plan([], [], 1000) == []


def test_a_packed_bucket_views_back_into_the_same_tensors():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g), torch.randn(7, generator=g).to(BF16), torch.randn(4, 4, generator=g)]
    shapes, dtypes = [list(t.shape) for t in tensors], [t.dtype for t in tensors]
    [bucket] = pack_plan(shapes, dtypes, 1 << 20)
    buf = torch.zeros(bucket_length(bucket, shapes, dtypes), dtype=torch.uint8)
    for i, offset in bucket:
        flat = tensors[i].reshape(-1).view(torch.uint8)
        buf[offset : offset + flat.numel()].copy_(flat)
    for i, offset in bucket:
        size = tensors[i].numel() * tensors[i].element_size()
        back = buf[offset : offset + size].view(dtypes[i]).view(shapes[i])
        assert back.dtype == tensors[i].dtype and torch.equal(back, tensors[i])
