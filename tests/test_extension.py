"""The contract between the Python layer and flashhopper._C, checked without a GPU."""
from __future__ import annotations

import pytest
import torch

from flashhopper import _ext, build_info, compiled_kernels, extension_error, has_extension
from flashhopper.ops import fill_bwd_params, fill_params
from flashhopper.validation import KERNEL_HEADDIMS


def test_status_is_consistent() -> None:
    assert has_extension() == (extension_error() is None)
    if not has_extension():
        assert compiled_kernels() == [] and build_info() == {}


needs_ext = pytest.mark.skipif(not has_extension(), reason=f"no compiled extension ({extension_error()})")


@needs_ext
def test_kernel_list() -> None:
    for k in compiled_kernels():
        assert k["mode"] in ("fwd", "bwd") and k["arch"] in (90, 80)
        assert k["dtype"] in ("bfloat16", "float16", "float8_e4m3fn") and k["headdim"] in KERNEL_HEADDIMS
        if k["dtype"] == "float8_e4m3fn":  # forward only, Hopper only; the PV GEMM's k is 32
            assert k["mode"] == "fwd" and k["arch"] == 90 and k["block_n"] % 32 == 0
        assert isinstance(k["causal"], bool)
        assert isinstance(k["block_m"], int) and isinstance(k["block_n"], int)
        key = (k["arch"], getattr(torch, k["dtype"]), k["headdim"], k["causal"])
        has = _ext.has_fwd_kernel if k["mode"] == "fwd" else _ext.has_bwd_kernel
        assert has(*key)
    assert not _ext.has_fwd_kernel(90, torch.bfloat16, 96, False)
    assert not _ext.has_bwd_kernel(90, torch.bfloat16, 96, False)
    # Each (mode, configuration) once.
    keys = [(k["mode"], k["arch"], k["dtype"], k["headdim"], k["causal"]) for k in compiled_kernels()]
    assert len(keys) == len(set(keys))


@needs_ext
def test_build_info() -> None:
    assert isinstance(build_info().get("cuda_runtime"), int)


@needs_ext
def test_fill_params_round_trip() -> None:
    # Every field the launcher reads is written, and reads back as written (pointers as ints,
    # strides in elements). CPU tensors: nothing is launched.
    C = _ext.extension()
    qkv = torch.randn(3, 20, 3, 8, 64, dtype=torch.bfloat16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1, :2], qkv[:, :, 2, :2]
    out, lse = torch.empty_like(q), torch.empty(3, 8, 20)
    counter = torch.zeros(1, dtype=torch.int32)
    p = fill_params(C.FwdParams(), q, k, v, out, lse, 0.125, True, counter.data_ptr())
    assert (p.q_ptr, p.k_ptr, p.v_ptr, p.o_ptr, p.lse_ptr, p.tile_counter) == tuple(
        x.data_ptr() for x in (q, k, v, out, lse, counter))
    assert (p.q_batch_stride, p.q_row_stride, p.q_head_stride) == (20 * 3 * 8 * 64, 3 * 8 * 64, 64)
    assert (p.k_batch_stride, p.k_row_stride, p.k_head_stride) == (20 * 3 * 8 * 64, 3 * 8 * 64, 64)
    assert (p.o_batch_stride, p.o_row_stride, p.o_head_stride) == (20 * 8 * 64, 8 * 64, 64)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.nheads_q, p.nheads_kv, p.headdim) == (3, 20, 20, 8, 2, 64)
    assert p.softmax_scale == 0.125 and p.causal is True and p.dtype == C.DType.bfloat16


@needs_ext
def test_fill_bwd_params_round_trip() -> None:
    # Same for the backward's parameters: every field written reads back as written.
    C = _ext.extension()
    qkv = torch.randn(3, 20, 3, 8, 64, dtype=torch.bfloat16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1, :2], qkv[:, :, 2, :2]
    out, dout, lse, dlse = torch.empty_like(q), torch.randn(3, 20, 8, 128, dtype=torch.bfloat16)[..., :64], \
        torch.empty(3, 8, 20), torch.empty(3, 8, 20)
    dq, dk, dv = torch.empty_like(q), torch.empty(3, 20, 2, 64, dtype=torch.bfloat16), \
        torch.empty(3, 20, 2, 64, dtype=torch.bfloat16)
    ws = torch.empty(256, dtype=torch.uint8)
    p = fill_bwd_params(C.BwdParams(), dout, q, k, v, out, lse, dlse, dq, dk, dv, 0.125, True, True, ws.data_ptr())
    assert (p.q_ptr, p.k_ptr, p.v_ptr, p.o_ptr, p.do_ptr, p.lse_ptr, p.dlse_ptr, p.dq_ptr, p.dk_ptr, p.dv_ptr,
            p.workspace) == tuple(x.data_ptr() for x in (q, k, v, out, dout, lse, dlse, dq, dk, dv, ws))
    assert (p.q_batch_stride, p.q_row_stride, p.q_head_stride) == (20 * 3 * 8 * 64, 3 * 8 * 64, 64)
    assert (p.v_batch_stride, p.v_row_stride, p.v_head_stride) == (20 * 3 * 8 * 64, 3 * 8 * 64, 64)
    assert (p.o_batch_stride, p.o_row_stride, p.o_head_stride) == (20 * 8 * 64, 8 * 64, 64)
    assert (p.do_batch_stride, p.do_row_stride, p.do_head_stride) == (20 * 8 * 128, 8 * 128, 128)
    assert (p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride) == (20 * 8 * 64, 8 * 64, 64)
    assert (p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride) == (20 * 2 * 64, 2 * 64, 64)
    assert (p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride) == (20 * 2 * 64, 2 * 64, 64)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.nheads_q, p.nheads_kv, p.headdim) == (3, 20, 20, 8, 2, 64)
    assert p.softmax_scale == 0.125 and p.causal is True and p.deterministic is True
    assert p.dtype == C.DType.bfloat16
    p = fill_bwd_params(p, dout, q, k, v, out, lse, None, dq, dk, dv, 0.5, False, False)
    assert p.dlse_ptr == 0 and p.workspace == 0 and p.causal is False and p.deterministic is False


@needs_ext
def test_missing_configuration_is_a_value_error() -> None:
    C = _ext.extension()
    p = C.FwdParams()
    p.headdim = 96  # no build has it: rejected before anything touches CUDA
    with pytest.raises(ValueError, match="no sm90 forward kernel"):
        C.fwd(p, 90, 0)
    b = C.BwdParams()
    b.headdim = 96
    with pytest.raises(ValueError, match="no sm90 backward kernel"):
        C.bwd_workspace_bytes(b, 90)
    with pytest.raises(ValueError, match="no sm90 backward kernel"):
        C.bwd(b, 90, 0)
