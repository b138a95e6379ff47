"""``tensor_ops.linear``: the fp32 and bf16 matmul on oneDNN-prepacked weights equals
F.linear (rows padded to a bucket, then dropped), and a weight written after packing is
repacked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prefill_node.model import tensor_ops
from prefill_node.model.tensor_ops import linear, set_onednn_matmul

needs_onednn = pytest.mark.skipif(not tensor_ops._ONEDNN, reason="torch built without oneDNN")
needs_bf16 = pytest.mark.skipif(
    torch.bfloat16 not in tensor_ops._PACKED_DTYPES, reason="no oneDNN bf16 kernels on this CPU"
)
# Both sides accumulate in fp32 and round once: fp32 agrees to accumulation order; bf16 to
# one bf16 rounding step (2**-8 relative), plus fp32-order noise near zero. (On the AMD EPYC
# used here the two gave identical bits in both dtypes.)
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-8, 1e-4)}


def _weight(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(rows, cols, generator=g).to(dtype), requires_grad=False)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
@pytest.mark.parametrize("rows", [32, 64, 100, 513])
def test_packed_matmul_equals_f_linear(rows: int, dtype: torch.dtype) -> None:
    w = _weight(96, 80, seed=rows, dtype=dtype)
    x = torch.randn(rows, 160).to(dtype)[:, ::2]  # strided, as a slice of a fused projection
    y = linear(x, w)
    assert getattr(w, tensor_ops._PACKED)[1].is_mkldnn  # the packed path ran
    assert y.shape == (rows, 96) and y.dtype == dtype  # the padding rows are dropped
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(y, F.linear(x, w), rtol=rtol, atol=atol)


@pytest.mark.parametrize("rows", [1, 7, tensor_ops.ROW_BUCKET - 1])
def test_fewer_rows_than_a_bucket_go_to_f_linear(rows: int) -> None:
    w = _weight(24, 16, seed=rows)
    x = torch.randn(rows, 16)
    assert torch.equal(linear(x, w), F.linear(x, w))
    assert not hasattr(w, tensor_ops._PACKED)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
def test_a_weight_written_after_packing_is_repacked(dtype: torch.dtype) -> None:
    w = _weight(32, 48, seed=1, dtype=dtype)
    x = torch.randn(40, 48).to(dtype)
    linear(x, w)
    with torch.no_grad():
        w.copy_(torch.randn(32, 48))
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=rtol, atol=atol)


def test_views_other_dtypes_and_the_switch_use_f_linear() -> None:
    w = _weight(16, 8, seed=2)
    x = torch.randn(tensor_ops.ROW_BUCKET, 8)
    assert torch.equal(linear(x, w[:4]), F.linear(x, w[:4]))  # a view: never cached
    wd = nn.Parameter(w.detach().double(), requires_grad=False)
    assert torch.equal(linear(x.double(), wd), F.linear(x.double(), wd))
    assert not hasattr(wd, tensor_ops._PACKED)
    set_onednn_matmul(False)
    try:
        assert torch.equal(linear(x, w), F.linear(x, w))
        assert not hasattr(w, tensor_ops._PACKED)
    finally:
        set_onednn_matmul(True)
