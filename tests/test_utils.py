"""Small shared helpers: `ints_to_device` packs a step's index tensors into one copy."""

import pytest
import torch

from radixlm.utils import ints_to_device


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_parts_come_back_in_order_with_their_values() -> None:
    big = torch.arange(1001, dtype=torch.int32)  # past the list limit: concatenated
    parts = [[5, 6, 7], torch.tensor([9, 8], dtype=torch.int32), [], big, [1]]
    out = ints_to_device(parts, _device())
    assert [t.tolist() for t in out] == [[5, 6, 7], [9, 8], [], big.tolist(), [1]]
    assert all(t.dtype == torch.int64 and t.dim() == 1 for t in out)


def test_every_part_starts_16_byte_aligned() -> None:
    """Triton specialises a launch on 16-byte pointer alignment: a misaligned part
    would compile another kernel variant mid-serving."""
    out = ints_to_device([[1], [2, 3, 4], torch.arange(7), torch.arange(999), [5]], _device())
    assert all(t.data_ptr() % 16 == 0 for t in out)


def test_one_buffer_behind_every_host_part() -> None:
    out = ints_to_device([[1, 2], torch.tensor([3]), [4, 5, 6]], _device())
    storage = {t.untyped_storage().data_ptr() for t in out}
    assert len(storage) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host tensors are the parts on CPU")
def test_a_tensor_already_on_the_device_is_not_copied() -> None:
    here = torch.tensor([4, 2], device="cuda")
    out = ints_to_device([[1], here], "cuda")
    assert out[1].data_ptr() == here.data_ptr()


@pytest.mark.parametrize("parts", [[], [[]]])
def test_nothing_to_copy(parts: list) -> None:
    assert [t.numel() for t in ints_to_device(parts, "cpu")] == [0] * len(parts)
