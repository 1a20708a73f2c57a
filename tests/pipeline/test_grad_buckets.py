"""The replica all-reduce's buckets: packing, the buffer a CPU bucket keeps, the sums."""
from __future__ import annotations

import pytest
import torch

from hapt_hf.pipeline.grad_sync import GradBuckets, flat_buffer, pack, unpack
from benchmarks.ranks import run_ranks


def _params(sizes, value=0.0):
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    for i, p in enumerate(ps):
        p.grad = torch.full((p.numel(),), value + i)
    return ps


def test_pack_and_unpack_round_trip_into_the_kept_buffer():
    ps = _params([3, 5, 2], value=1.0)
    flat = flat_buffer(ps)
    assert flat is not None and flat.numel() == 10 and flat.dtype == torch.float32
    out = pack([p.grad for p in ps], flat)
    assert out.data_ptr() == flat.data_ptr()  # packed in place, not a new buffer
    assert out.tolist() == [1.0] * 3 + [2.0] * 5 + [3.0] * 2
    grads = [torch.empty_like(p.grad) for p in ps]
    unpack(out * 2, grads)
    assert [g.tolist() for g in grads] == [[2.0] * 3, [4.0] * 5, [6.0] * 2]


def test_no_buffer_is_kept_for_no_parameters_or_off_the_cpu():
    assert flat_buffer([]) is None
    meta = [torch.nn.Parameter(torch.zeros(4, device="meta"))]
    assert flat_buffer(meta) is None
    assert pack([p.grad for p in _params([2, 2])], None).tolist() == [0.0, 0.0, 1.0, 1.0]


def _two_iterations(rank: int, world: int) -> tuple[list[list[float]], list[bool]]:
    import torch.distributed as dist
    ps = _params([4, 6, 3])
    buckets = GradBuckets(ps, dist.group.WORLD, bucket_bytes=8 * 4, overlap=False)
    before = [f.data_ptr() for f in buckets._flats]
    sums = []
    for it in range(2):
        for p in ps:
            p.grad = torch.full_like(p, float(rank + 10 * it))
        buckets.launch_rest()
        buckets.wait()
        sums.append([p.grad[0].item() for p in ps])
    return sums, [f.data_ptr() == b for f, b in zip(buckets._flats, before)]


@pytest.mark.multiproc
def test_cpu_buckets_sum_over_replicas_and_keep_their_buffers_across_iterations():
    out = run_ranks(_two_iterations, 2)
    for o in out:
        sums, kept = o.value
        assert sums == [[1.0] * 3, [21.0] * 3]  # ranks 0 + 1, then 10 + 11
        assert len(kept) == 2 and all(kept)  # 24 B, then 16 + 12 B: two buckets
