"""Weight buckets without servers: flatten round-trip, tensor handles through shared
memory into another process, the restricted unpickler, the atomic safetensors write."""

import base64
import pickle
import subprocess
import sys

import pytest
import torch

from rl_sglang.engine.weights import (
    HeldBuffers,
    KeptBucket,
    copy_into_model,
    deserialize_bucket,
    named_tensors_from_payload,
    read_safetensors_dir,
    record_view,
    unflatten_bucket,
)
from rl_sglang.transports import (
    SendBuffer,
    dump_payload,
    flatten_bucket,
    save_weights_atomic,
    serialize_bucket,
)


def bucket():
    return [
        ("a", torch.arange(6, dtype=torch.float32).view(2, 3)),
        ("b", torch.tensor([1, 2, 3], dtype=torch.int64)),
        ("c", torch.tensor([0.5, -1.5], dtype=torch.bfloat16)),
    ]


def test_flatten_round_trip_keeps_names_shapes_dtypes_values():
    flat = flatten_bucket(bucket())
    assert flat["flattened_tensor"].dtype == torch.uint8
    assert flat["flattened_tensor"].numel() == 6 * 4 + 3 * 8 + 2 * 2
    for (name, tensor), (name2, tensor2) in zip(bucket(), unflatten_bucket(flat), strict=True):
        assert name == name2 and tensor2.dtype == tensor.dtype and torch.equal(tensor, tensor2)


@pytest.mark.parametrize("flatten", [False, True])
def test_serialized_bucket_opens_in_an_unrelated_process(flatten):
    payload, keep_alive = serialize_bucket(bucket(), flatten=flatten)
    script = (
        "import sys, torch; from rl_sglang.engine.weights import named_tensors_from_payload as f;"
        "named = f([sys.stdin.read()], sys.argv[1] or None);"
        "print(sum(float(t.double().sum()) for _, t in named), [n for n, _ in named])"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, "flattened_bucket" if flatten else ""],
        input=payload,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == str(15.0 + 6 + (0.5 - 1.5))
    del keep_alive


def test_restricted_unpickler_refuses_arbitrary_code():
    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("echo pwned",))

    payload = base64.b64encode(pickle.dumps(Evil())).decode()
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        deserialize_bucket(payload)
    with pytest.raises(ValueError, match="load_format"):
        named_tensors_from_payload([serialize_bucket(bucket())[0]], "npz")


def test_save_weights_atomic_replaces_and_reads_back(tmp_path):
    target = tmp_path / "weights"
    save_weights_atomic(bucket(), target)
    save_weights_atomic([(n, t * 2) for n, t in bucket()], target)
    loaded = dict(read_safetensors_dir(target))
    assert torch.equal(loaded["b"], torch.tensor([2, 4, 6]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights"]  # no staging leftovers


def test_copy_into_model_validates_before_touching(tiny_model):
    import copy

    model = copy.deepcopy(tiny_model)
    before = model.lm_head.weight.clone()
    with pytest.raises(ValueError, match="unknown weight"):
        copy_into_model(model, [("lm_head.weight", before * 0), ("nope", before)])
    with pytest.raises(ValueError, match="shape"):
        copy_into_model(model, [("lm_head.weight", before[:1])])
    assert torch.equal(model.lm_head.weight, before)
    assert copy_into_model(model, [("lm_head.weight", before * 3)]) == 1
    assert torch.equal(model.lm_head.weight, before * 3)


def test_send_buffer_is_filled_in_place_until_the_layout_outgrows_it():
    buffer = SendBuffer()
    first = buffer.fill(bucket())
    storage = first["flattened_tensor"].untyped_storage().data_ptr()
    doubled = [(n, t * 2) for n, t in bucket()]
    again = buffer.fill(doubled)
    assert again["flattened_tensor"].untyped_storage().data_ptr() == storage
    assert again["metadata"] is first["metadata"]  # the records are made once per layout
    for (name, tensor), (name2, tensor2) in zip(doubled, unflatten_bucket(again), strict=True):
        assert name == name2 and torch.equal(tensor, tensor2)
    renamed = [(f"x.{n}", t) for n, t in bucket()[:2]]  # another layout, fits: same storage
    smaller = buffer.fill(renamed)
    assert smaller["flattened_tensor"].untyped_storage().data_ptr() == storage
    assert [m.name for m in smaller["metadata"]] == ["x.a", "x.b"]
    assert torch.equal(unflatten_bucket(smaller)[1][1], torch.tensor([1, 2, 3]))
    larger = [*bucket(), ("d", torch.ones(100))]  # outgrows it: a new storage
    out = buffer.fill(larger)
    assert buffer.num_allocations == 2 and buffer.nbytes == out["flattened_tensor"].numel()
    assert torch.equal(unflatten_bucket(out)[3][1], torch.ones(100))
    buffer.release()
    assert buffer.nbytes == 0


def test_held_buffers_reuse_a_kept_buffers_views_and_keep_the_last_two_storages():
    """Through one kept buffer with one layout the same KeptBucket comes back, its views
    showing the new bytes; another layout gets its own; the oldest of three storages goes."""
    held, buffer = HeldBuffers(limit=2), SendBuffer()

    def receive(send_buffer, named):
        payload = dump_payload(send_buffer.fill(named))
        return held.named_tensors([payload], "flattened_bucket")

    first = receive(buffer, bucket())
    doubled = [(n, t * 2) for n, t in bucket()]
    again = receive(buffer, doubled)
    assert isinstance(first, KeptBucket) and again is first
    for (name, tensor), (name2, tensor2) in zip(doubled, again, strict=True):
        assert name == name2 and torch.equal(tensor, tensor2)
    other = receive(buffer, bucket()[:2])  # another layout in the same storage
    assert other is not first and len(held) == 1
    for _ in range(3):
        receive(SendBuffer(), bucket())
    assert len(held) == 2  # the first buffer's storage is no longer held
    assert receive(buffer, bucket()) is not first
    per_tensor = held.named_tensors([serialize_bucket(bucket())[0]], None)
    assert not isinstance(per_tensor, KeptBucket) and len(held) == 2
    held.drop()
    assert len(held) == 0


def test_a_layout_differing_in_one_record_field_is_cut_again():
    """A kept buffer's layout is reused only when every record matches (name, byte range,
    dtype, shape): the same number of records at the same place with one field changed is
    another layout, whose views show its own dtype and shape; the records decode to the
    fields the sender wrote."""
    held, buffer = HeldBuffers(), SendBuffer()

    def receive(named):
        return held.named_tensors([dump_payload(buffer.fill(named))], "flattened_bucket")

    first = receive(bucket())
    assert [dict(r) for r in first.records] == [
        {"name": n, "shape": tuple(t.shape), "dtype": t.dtype} | fields
        for (n, t), fields in zip(bucket(), _byte_ranges(bucket()), strict=True)
    ]
    renamed = [("z", bucket()[0][1]), *bucket()[1:]]
    reshaped = [("a", bucket()[0][1].view(3, 2)), *bucket()[1:]]
    retyped = [*bucket()[:2], ("c", torch.tensor([7, 9], dtype=torch.int16))]
    for changed in (renamed, reshaped, retyped):
        got = receive(changed)
        assert got is not first and [n for n, _ in got] == [n for n, _ in changed]
        for (_, sent), (_, seen) in zip(changed, got, strict=True):
            assert seen.dtype == sent.dtype and torch.equal(seen, sent)
    assert receive(bucket()) is first


def _byte_ranges(named) -> list[dict]:
    ranges, start = [], 0
    for _, tensor in named:
        size = tensor.numel() * tensor.element_size()
        ranges.append({"start_idx": start, "end_idx": start + size, "numel": size})
        start += size
    return ranges


def test_unflatten_cuts_what_record_view_cuts_in_every_dtype_and_refuses_bad_records():
    """The one-op views of a bucket's records are record_view's (same bytes, shape, dtype
    and strides), for dtypes of every width packed back to back, scalars and empty tensors
    included; a record running past the buffer, or not aligned to its dtype, is refused
    as record_view refuses it."""
    named = [
        ("wide", torch.arange(6, dtype=torch.float64).view(3, 1, 2)),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.zeros(0, 5)),
        ("tail", torch.arange(4, dtype=torch.int32)),
        ("half", torch.randn(3, 4).to(torch.bfloat16)),
        ("bytes", torch.tensor([1, 2, 3], dtype=torch.int8)),
        ("flag", torch.tensor([True, False, True])),
    ]
    flat = flatten_bucket(named)
    for (name, tensor), (name2, cut), meta in zip(
        named, unflatten_bucket(flat), flat["metadata"], strict=True
    ):
        view = record_view(flat["flattened_tensor"], meta)
        assert name == name2 and cut.dtype == tensor.dtype and torch.equal(cut, tensor)
        assert cut.shape == view.shape and cut.stride() == view.stride()
        assert cut.data_ptr() == view.data_ptr()
    flat["metadata"][3].end_idx += 4  # runs into the next record
    with pytest.raises(RuntimeError):
        unflatten_bucket(flat)
    misaligned = flatten_bucket([("byte", torch.ones(1, dtype=torch.int8)), *named[4:5]])
    with pytest.raises(RuntimeError, match="divisible"):
        unflatten_bucket(misaligned)
