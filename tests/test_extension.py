"""The contract between the Python layer and flashhopper._C, checked without a GPU."""
from __future__ import annotations

import pytest
import torch

from flashhopper import _ext, build_info, compiled_kernels, extension_error, has_extension
from flashhopper.kernel_key import HEADDIM_PAIRS, KernelKey, from_dict
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
        # A V head dim of its own only in the pairs the kernels build (Q/K 192 with V 128, Q/K 128 with V 64).
        assert k["headdim_v"] == k["headdim"] or (k["headdim"], k["headdim_v"]) in HEADDIM_PAIRS
        assert k["mask"] in ("none", "causal", "window") and isinstance(k["variant"], str)
        assert k["score_mod"] in ("none", "softcap") and isinstance(k["dropout"], bool)
        if k["dtype"] == "float8_e4m3fn":  # forward only, Hopper only, no score mod or dropout; the PV GEMM's k is 32
            assert k["mode"] == "fwd" and k["arch"] == 90 and k["block_n"] % 32 == 0 and k["score_mod"] == "none"
            assert not k["dropout"]
        assert "causal" not in k  # the mask kind says it
        assert isinstance(k["block_m"], int) and isinstance(k["block_n"], int)
        assert _ext.kernel(k["mode"], from_dict(k)) == _ext.Entry(k["index"], k["block_m"], k["block_n"],
                                                                  k["block_n_short"], k["short_keys_max"])
        # A short tile only beside the padded e4m3, 16-bit head-dim-96 and Q/K 128 V 64 forwards (cpp/sm90/tile_size.h:
        # ShortKeys).
        padded = k["mode"] == "fwd" and k["kvcache"] == "off" and not k["varlen"] and k["variant"] == ""
        short_16bit = k["arch"] == 90 and (k["headdim"], k["headdim_v"]) in ((96, 96), (128, 64))
        padded_short = padded and (k["dtype"] == "float8_e4m3fn" or short_16bit)
        assert k["block_n_short"] == 0 or padded_short, k
    assert _ext.kernel("fwd", KernelKey(90, "bfloat16", 80, 80, "none")) is None
    assert _ext.kernel("bwd", KernelKey(90, "bfloat16", 80, 80, "none")) is None
    # Each (mode, key) once; each mode's indices are its positions, what _C.fwd / _C.bwd take.
    keys = [(k["mode"], from_dict(k)) for k in compiled_kernels()]
    assert len(keys) == len(set(keys))
    for mode in ("fwd", "bwd"):
        assert sorted(k["index"] for k in compiled_kernels() if k["mode"] == mode) == \
            list(range(sum(k["mode"] == mode for k in compiled_kernels())))


@needs_ext
def test_build_info() -> None:
    info = build_info()
    assert isinstance(info.get("cuda_runtime"), int)
    for field in ("archs", "modes", "dtypes", "headdims", "masks", "variants"):
        assert isinstance(info[field], list), field
    # How the families were chosen: FLASHHOPPER_ARCHS, or auto from the visible GPUs (cmake/DetectGpuArchs.cmake).
    assert info["archs_from"] == "FLASHHOPPER_ARCHS" or info["archs_from"].startswith(("auto, ", "link_prebuilt"))


@needs_ext
def test_params_have_the_contract_fields() -> None:
    # The kernel is chosen by its key: the params carry no mask kind nor dtype, only the window edges.
    C = _ext.extension()
    for p in (C.FwdParams(), C.BwdParams()):
        assert not hasattr(p, "causal") and not hasattr(p, "dtype")
        assert (p.window_left, p.window_right, p.headdim_v) == (-1, -1, 0)


@needs_ext
def test_fill_params_round_trip() -> None:
    # Every field the launcher reads is written, and reads back as written (pointers as ints,
    # strides in elements). CPU tensors: nothing is launched.
    C = _ext.extension()
    qkv = torch.randn(3, 20, 3, 8, 64, dtype=torch.bfloat16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1, :2], qkv[:, :, 2, :2]
    out, lse = torch.empty_like(q), torch.empty(3, 8, 20)
    counter = torch.zeros(1, dtype=torch.int32)
    p = fill_params(C.FwdParams(), q, k, v, out, lse, 0.125, (17, 0), counter.data_ptr())
    assert (p.q_ptr, p.k_ptr, p.v_ptr, p.o_ptr, p.lse_ptr, p.tile_counter) == tuple(
        x.data_ptr() for x in (q, k, v, out, lse, counter))
    assert (p.q_batch_stride, p.q_row_stride, p.q_head_stride) == (20 * 3 * 8 * 64, 3 * 8 * 64, 64)
    assert (p.k_batch_stride, p.k_row_stride, p.k_head_stride) == (20 * 3 * 8 * 64, 3 * 8 * 64, 64)
    assert (p.o_batch_stride, p.o_row_stride, p.o_head_stride) == (20 * 8 * 64, 8 * 64, 64)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.nheads_q, p.nheads_kv, p.headdim, p.headdim_v) == (3, 20, 20, 8, 2,
                                                                                                   64, 64)
    assert p.softmax_scale == 0.125 and (p.window_left, p.window_right) == (17, 0)
    p = fill_params(p, q, k, v, out, lse, 0.5)
    assert (p.window_left, p.window_right, p.tile_counter) == (-1, -1, 0)


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
    p = fill_bwd_params(C.BwdParams(), dout, q, k, v, out, lse, dlse, dq, dk, dv, 0.125, True, (5, 3), ws.data_ptr())
    assert (p.q_ptr, p.k_ptr, p.v_ptr, p.o_ptr, p.do_ptr, p.lse_ptr, p.dlse_ptr, p.dq_ptr, p.dk_ptr, p.dv_ptr,
            p.workspace) == tuple(x.data_ptr() for x in (q, k, v, out, dout, lse, dlse, dq, dk, dv, ws))
    assert (p.q_batch_stride, p.q_row_stride, p.q_head_stride) == (20 * 3 * 8 * 64, 3 * 8 * 64, 64)
    assert (p.v_batch_stride, p.v_row_stride, p.v_head_stride) == (20 * 3 * 8 * 64, 3 * 8 * 64, 64)
    assert (p.o_batch_stride, p.o_row_stride, p.o_head_stride) == (20 * 8 * 64, 8 * 64, 64)
    assert (p.do_batch_stride, p.do_row_stride, p.do_head_stride) == (20 * 8 * 128, 8 * 128, 128)
    assert (p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride) == (20 * 8 * 64, 8 * 64, 64)
    assert (p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride) == (20 * 2 * 64, 2 * 64, 64)
    assert (p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride) == (20 * 2 * 64, 2 * 64, 64)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.nheads_q, p.nheads_kv, p.headdim, p.headdim_v) == (3, 20, 20, 8, 2,
                                                                                                   64, 64)
    assert p.softmax_scale == 0.125 and p.deterministic is True and (p.window_left, p.window_right) == (5, 3)
    p = fill_bwd_params(p, dout, q, k, v, out, lse, None, dq, dk, dv, 0.5, False)
    assert p.dlse_ptr == 0 and p.workspace == 0 and p.deterministic is False
    assert (p.window_left, p.window_right) == (-1, -1)


@needs_ext
def test_unknown_kernel_index_is_a_value_error() -> None:
    # Rejected before anything touches CUDA.
    C = _ext.extension()
    n_fwd = sum(k["mode"] == "fwd" for k in compiled_kernels())
    n_bwd = sum(k["mode"] == "bwd" for k in compiled_kernels())
    with pytest.raises(ValueError, match="no forward kernel with index"):
        C.fwd(C.FwdParams(), n_fwd, 0)
    with pytest.raises(ValueError, match="no forward kernel with index"):
        C.fwd(C.FwdParams(), -1, 0)
    with pytest.raises(ValueError, match="no backward kernel with index"):
        C.bwd_workspace_bytes(C.BwdParams(), n_bwd)
    with pytest.raises(ValueError, match="no backward kernel with index"):
        C.bwd(C.BwdParams(), n_bwd, 0)
