import pytest
import torch

from rl_core.weights import bucket_by_bytes


def test_buckets_by_hand():
    named = [
        ("a", torch.zeros(2)),  # 8 bytes
        ("b", torch.zeros(3)),  # 12
        ("c", torch.zeros(10)),  # 40: larger than the bound, alone
        ("d", torch.zeros(1, dtype=torch.bfloat16)),  # 2
    ]
    buckets = list(bucket_by_bytes(iter(named), bucket_bytes=20))
    assert [[name for name, _ in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert list(bucket_by_bytes([], bucket_bytes=1)) == []
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucket_by_bytes(named, bucket_bytes=0))


def test_consumes_lazily():
    seen = []

    def produce():
        for i in range(4):
            seen.append(i)
            yield str(i), torch.zeros(4)  # 16 bytes each

    first = next(bucket_by_bytes(produce(), bucket_bytes=32))
    assert [name for name, _ in first] == ["0", "1"]
    assert seen == [0, 1, 2]  # one tensor beyond the bucket, never the whole model
