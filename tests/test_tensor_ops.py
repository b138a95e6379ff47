"""``tensor_ops.linear``: the fp32 matmul on oneDNN-prepacked weights equals F.linear (rows
padded to a bucket, then dropped), and a weight written after packing is repacked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prefill_node.model import tensor_ops
from prefill_node.model.tensor_ops import linear, set_onednn_matmul

needs_onednn = pytest.mark.skipif(not tensor_ops._ONEDNN, reason="torch built without oneDNN")


def _weight(rows: int, cols: int, seed: int) -> nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(rows, cols, generator=g), requires_grad=False)


@needs_onednn
@pytest.mark.parametrize("rows", [32, 64, 100, 513])
def test_packed_matmul_equals_f_linear(rows: int) -> None:
    w = _weight(96, 80, seed=rows)
    x = torch.randn(rows, 160)[:, ::2]  # a strided view, as a slice of a fused projection is
    y = linear(x, w)
    assert getattr(w, tensor_ops._PACKED)[1].is_mkldnn  # the packed path ran
    assert y.shape == (rows, 96)  # the padding rows are dropped
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, tensor_ops.ROW_BUCKET - 1])
def test_fewer_rows_than_a_bucket_go_to_f_linear(rows: int) -> None:
    w = _weight(24, 16, seed=rows)
    x = torch.randn(rows, 16)
    assert torch.equal(linear(x, w), F.linear(x, w))
    assert not hasattr(w, tensor_ops._PACKED)


@needs_onednn
def test_a_weight_written_after_packing_is_repacked() -> None:
    w = _weight(32, 48, seed=1)
    x = torch.randn(40, 48)
    linear(x, w)
    with torch.no_grad():
        w.copy_(torch.randn(32, 48))
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_views_other_dtypes_and_the_switch_use_f_linear() -> None:
    w = _weight(16, 8, seed=2)
    x = torch.randn(tensor_ops.ROW_BUCKET, 8)
    assert torch.equal(linear(x, w[:4]), F.linear(x, w[:4]))  # a view: never cached
    wb = nn.Parameter(w.detach().to(torch.bfloat16), requires_grad=False)
    assert torch.equal(linear(x.to(torch.bfloat16), wb), F.linear(x.to(torch.bfloat16), wb))
    assert not hasattr(wb, tensor_ops._PACKED)
    set_onednn_matmul(False)
    try:
        assert torch.equal(linear(x, w), F.linear(x, w))
        assert not hasattr(w, tensor_ops._PACKED)
    finally:
        set_onednn_matmul(True)
