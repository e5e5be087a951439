"""The launch plumbing of ops.py (kernel choice by key, params, workspace, stream, tile counter, empty
inputs), with the extension replaced by a recorder so that it runs without a GPU. Kernels themselves
(and _C.fwd/_C.bwd's device switch): test_fwd_gpu.py, test_bwd_gpu.py."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import randn_qkv, with_pointers

from flashhopper import _device, _ext, _launch, ops
from flashhopper.kernel_key import KernelKey, from_dict

Call = tuple[dict[str, Any], int, int]


class FakeC:
    """_C's API: kernels() entries with an index per mode; fwd / bwd take (params, index, stream) and
    return the CTAs launched."""

    class FwdParams(SimpleNamespace):
        def __init__(self) -> None:
            super().__init__(num_sms=0)  # the real ones have every field from the start

    class BwdParams(FwdParams):
        pass

    def __init__(self) -> None:
        rows = [(mode, arch, dtype, mask, score_mod, dropout) for mode in ("fwd", "bwd") for arch in (90, 80)
                for dtype in ("bfloat16", "float16") for mask in ("none", "causal", "window")
                for score_mod in ("none", "softcap") for dropout in (False, True)]
        self.table: list[dict[str, Any]] = []
        for mode, arch, dtype, mask, score_mod, dropout in rows:
            for headdim in (64, 128):
                index = sum(k["mode"] == mode for k in self.table)
                self.table.append({"mode": mode, "index": index, "arch": arch, "dtype": dtype, "headdim": headdim,
                                   "headdim_v": headdim, "mask": mask, "variant": "", "score_mod": score_mod,
                                   "dropout": dropout, "varlen": False, "kvcache": "off", "block_m": 128,
                                   "block_n": 64})
        self.calls: list[Call] = []
        self.bwd_calls: list[Call] = []
        self.workspace_queries: list[tuple[dict[str, Any], int]] = []
        self.workspace_bytes = 4096 + 17
        self.ctas = 7

    def kernels(self) -> list[dict[str, Any]]:
        return self.table

    def key_of(self, mode: str, index: int) -> KernelKey:
        (entry,) = (k for k in self.table if (k["mode"], k["index"]) == (mode, index))
        return from_dict(entry)

    def fwd_with(self, params: FwdParams, index: int, stream: int, *pointers: int) -> int:
        """_C.fwd_with: recorded as fwd() with the pointers in the params; the prepared object is left as it was."""
        return self.fwd(with_pointers(params, *pointers), index, stream)

    def fwd(self, params: FwdParams, index: int, stream: int) -> int:
        self.calls.append((dict(vars(params)), index, stream))
        return self.ctas

    def bwd_workspace_bytes(self, params: BwdParams, index: int) -> int:
        self.workspace_queries.append((dict(vars(params)), index))
        return self.workspace_bytes

    def bwd(self, params: BwdParams, index: int, stream: int) -> int:
        self.bwd_calls.append((dict(vars(params)), index, stream))
        return self.ctas


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeC]:
    c = FakeC()
    table = {(k["mode"], from_dict(k)): _ext.Entry(k["index"], k["block_m"], k["block_n"]) for k in c.kernels()}
    monkeypatch.setattr(_ext, "extension", lambda: c)
    monkeypatch.setattr(_ext, "kernel", lambda mode, key: table.get((mode, key)))
    monkeypatch.setattr(_launch, "_local", threading.local())
    monkeypatch.setattr(_device, "device_info", lambda index: _device.DeviceInfo("fake", (9, 0), 132))
    monkeypatch.setattr(_launch, "_raw_stream", lambda index: 4242)
    # CPU stand-ins for the per-stream tile counters (keyed (None, stream): CPU tensors have no index).
    monkeypatch.setattr(_launch, "_capturing", lambda: False)
    monkeypatch.setattr(_launch, "_tile_counters", {})
    yield c


def fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, backend: str,
           window: tuple[int, int] = (-1, -1), deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.flashhopper.fwd.default(q, k, v, scale, causal, *window, 0.0, None, deterministic, backend)


def test_op_launches_the_keyed_kernel_on_the_current_stream(fake: FakeC) -> None:
    c = fake
    q, k, v = randn_qkv(2, 40, 56, 8, 2, 128, torch.bfloat16)
    out, lse = fwd_op(q, k, v, 0.3, True, "sm80")
    assert len(c.calls) == 1
    p, index, stream = c.calls[0]
    assert c.key_of("fwd", index) == KernelKey(80, "bfloat16", 128, 128, "causal") and stream == 4242
    assert p["q_ptr"] == q.data_ptr() and p["o_ptr"] == out.data_ptr() and p["lse_ptr"] == lse.data_ptr()
    assert (p["seqlen_q"], p["seqlen_k"], p["nheads_q"], p["nheads_kv"]) == (40, 56, 8, 2)
    assert (p["headdim"], p["headdim_v"], p["softmax_scale"]) == (128, 128, 0.3)
    assert (p["window_left"], p["window_right"]) == (-1, -1)  # causal's edge is the kernel's own
    assert "causal" not in p and "dtype" not in p  # the key chose the kernel
    assert (p["device"], p["num_sms"], p["max_smem_bytes"]) == (None, 132, 0)
    assert p["tile_counter"] == _launch._tile_counters[(None, 4242)].data_ptr() != 0  # type: ignore[index]


@pytest.mark.parametrize(("causal", "window", "mask", "edges"), [
    (False, (-1, -1), "none", (-1, -1)),
    (True, (-1, -1), "causal", (-1, -1)),
    (False, (17, -1), "window", (17, -1)),
    (False, (-1, 0), "window", (-1, 0)),
    (False, (0, 0), "window", (0, 0)),
    (True, (8, 8), "window", (8, 0)),  # causal: the right edge is min(right, 0)
    (True, (-1, 5), "window", (-1, 0)),
    (False, (10**9, 3), "window", (16 + 24, 3)),  # past every key: capped, far from 32-bit overflow
])
def test_window_selects_the_kernel_and_fills_the_edges(fake: FakeC, causal: bool, window: tuple[int, int],
                                                       mask: str, edges: tuple[int, int]) -> None:
    q, k, v = randn_qkv(1, 16, 24, 2, 2, 64, torch.float16)
    fwd_op(q, k, v, 0.1, causal, "sm90", window)
    torch.ops.flashhopper.bwd.default(torch.randn_like(q), q, k, v, torch.randn_like(q), torch.randn(1, 2, 16), None,
                                      0.1, causal, *window, 0.0, None, False, "sm90")
    (p, index, _), (pb, index_b, _) = fake.calls[0], fake.bwd_calls[0]
    assert fake.key_of("fwd", index) == fake.key_of("bwd", index_b) == KernelKey(90, "float16", 64, 64, mask)
    assert (p["window_left"], p["window_right"]) == (pb["window_left"], pb["window_right"]) == edges
    # Masks with a right edge take tiles from a counter; the static scheduler (mask none) needs none.
    assert (p["tile_counter"] != 0) == (mask != "none")


def test_softcap_and_sinks_reach_the_params(fake: FakeC) -> None:
    """softcap picks the softcap kernel and passes its value; sinks are a runtime pointer of any kernel. The
    reused params object forgets both on the next call without them; the backward gets a per-row d(sinks)
    buffer and the op returns its sum."""
    q, k, v = randn_qkv(1, 16, 24, 4, 2, 64, torch.bfloat16)
    sinks = torch.randn(4)
    torch.ops.flashhopper.fwd.default(q, k, v, 0.1, True, -1, -1, 30.0, sinks, False, "sm90")
    fwd_op(q, k, v, 0.1, True, "sm90")
    (p1, i1, _), (p2, i2, _) = fake.calls
    assert fake.key_of("fwd", i1) == KernelKey(90, "bfloat16", 64, 64, "causal", score_mod="softcap")
    assert fake.key_of("fwd", i2) == KernelKey(90, "bfloat16", 64, 64, "causal")
    assert (p1["softcap"], p1["sinks_ptr"]) == (30.0, sinks.data_ptr())
    assert (p2["softcap"], p2["sinks_ptr"]) == (0.0, 0)
    out, lse = torch.randn_like(q), torch.randn(1, 4, 16)
    dq, dk, dv, dsinks = torch.ops.flashhopper.bwd.default(torch.randn_like(q), q, k, v, out, lse, None, 0.1, True,
                                                           -1, -1, 30.0, sinks, False, "sm90")
    pb = fake.bwd_calls[0][0]
    assert pb["softcap"] == 30.0 and pb["sinks_ptr"] == sinks.data_ptr() and pb["dsinks_rows_ptr"] != 0
    assert dsinks.shape == (4,) and dsinks.dtype == torch.float32
    *_, none = torch.ops.flashhopper.bwd.default(torch.randn_like(q), q, k, v, out, lse, None, 0.1, True, -1, -1, 0.0,
                                                 None, False, "sm90")
    assert none.numel() == 0 and fake.bwd_calls[1][0]["dsinks_rows_ptr"] == 0


def test_params_object_is_reused(fake: FakeC) -> None:
    c = fake
    q, k, v = randn_qkv(1, 16, 16, 2, 2, 64, torch.float16)
    fwd_op(q, k, v, 0.1, False, "sm90")
    first = _launch.params("FwdParams")
    fwd_op(q, k, v, 0.2, True, "sm90", (3, 3))
    assert _launch.params("FwdParams") is first and len(c.calls) == 2
    assert c.key_of("fwd", c.calls[1][1]).mask == "window" and c.calls[1][0]["window_right"] == 0


@pytest.mark.parametrize("shape", [(0, 16, 16, 2, 2), (2, 0, 16, 2, 2), (2, 16, 0, 2, 2), (2, 16, 16, 0, 0)])
def test_empty_inputs_reach_the_launcher(fake: FakeC, shape: tuple[int, ...]) -> None:
    # The launchers handle empty inputs (an empty grid returns 0; no keys still runs the kernel, which
    # writes out = 0, lse = -inf): Python passes them on instead of answering itself.
    q, k, v = randn_qkv(*shape, 64, torch.bfloat16)
    out, lse = fwd_op(q, k, v, 0.1, True, "sm90")
    assert out.shape == q.shape and lse.shape == (shape[0], shape[3], shape[1])
    (p, _, _), = fake.calls
    assert (p["batch"], p["seqlen_q"], p["seqlen_k"], p["nheads_q"], p["nheads_kv"]) == shape


def test_fwd_into_returns_the_ctas(fake: FakeC, monkeypatch: pytest.MonkeyPatch) -> None:
    # fwd_into refuses CPU tensors; the fake launch path takes them.
    q, k, v = randn_qkv(1, 16, 16, 2, 2, 64, torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    fake.ctas = 0
    assert ops.fwd_into(q, k, v, torch.empty_like(q), torch.empty(1, 2, 16), 0.1, False, 90) == 0
    fake.ctas = 12
    assert ops.fwd_into(q, k, v, torch.empty_like(q), torch.empty(1, 2, 16), 0.1, False, 90, window=(4, 4)) == 12
    assert fake.key_of("fwd", fake.calls[1][1]).mask == "window"


def test_missing_kernel_is_a_value_error(fake: FakeC) -> None:
    q, k, v = randn_qkv(1, 16, 16, 2, 2, 256, torch.bfloat16)  # no headdim 256 in the fake build
    with pytest.raises(ValueError, match=r"^arch=90: this build has no sm90 forward kernel for bfloat16 headdim 256"):
        fwd_op(q, k, v, 0.1, False, "sm90")
    assert fake.calls == []


def test_layout_checked_before_launch(fake: FakeC) -> None:
    c = fake
    q, k, v = randn_qkv(2, 16, 16, 2, 2, 64, torch.bfloat16)
    k = torch.randn(2, 16, 2, 65, dtype=torch.bfloat16)[..., :64]  # row stride 130 elements = 260 bytes
    with pytest.raises(ValueError, match=r"^k row stride"):
        fwd_op(q, k, v, 0.1, False, "sm90")
    assert c.calls == []


def test_unknown_backend(fake: FakeC) -> None:
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        fwd_op(*randn_qkv(1, 4, 4, 2, 2, 64), 0.1, False, "triton")


# --- backward ---

@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Every torch.empty of uint8 (the workspace) made while the test runs."""
    made: list[tuple[tuple[int, ...], torch.dtype]] = []
    real_empty = torch.empty

    def empty(*size: Any, **kw: Any) -> torch.Tensor:
        t = real_empty(*size, **kw)
        if t.dtype == torch.uint8:
            made.append((tuple(t.shape), t.dtype))
        return t

    monkeypatch.setattr(torch, "empty", empty)
    return made


def bwd_inputs(b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dtype: torch.dtype = torch.bfloat16
               ) -> tuple[torch.Tensor, ...]:
    q, k, v = randn_qkv(b, sq, sk, hq, hkv, d, dtype)
    out, lse = torch.randn_like(q), torch.randn(b, hq, sq)
    return torch.randn_like(q), q, k, v, out, lse


def bwd_op(*args: Any, causal: bool = False, window: tuple[int, int] = (-1, -1), deterministic: bool = False,
           backend: str = "sm90", scale: float = 0.1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """args: dout, q, k, v, out, lse, dlse; returns dq, dk, dv (no sinks)."""
    return torch.ops.flashhopper.bwd.default(*args, scale, causal, *window, 0.0, None, deterministic, backend)[:3]


def test_bwd_launches_the_keyed_kernel_on_the_current_stream(fake: FakeC, allocations: list[Any]) -> None:
    c = fake
    qkv = torch.randn(2, 40, 3, 8, 128, dtype=torch.bfloat16)  # packed: strided q, and GQA k, v
    q, k, v = qkv[:, :, 0], qkv[:, :, 1, :2], qkv[:, :, 2, :2]
    dout, out, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(2, 8, 40)
    dq, dk, dv = bwd_op(dout, q, k, v, out, lse, None, causal=True, deterministic=True, backend="sm80", scale=0.3)
    assert len(c.bwd_calls) == 1 and c.calls == []
    p, index, stream = c.bwd_calls[0]
    assert c.key_of("bwd", index) == KernelKey(80, "bfloat16", 128, 128, "causal") and stream == 4242
    assert (p["q_ptr"], p["k_ptr"], p["v_ptr"], p["o_ptr"], p["do_ptr"], p["lse_ptr"]) == tuple(
        x.data_ptr() for x in (q, k, v, out, dout, lse))
    assert (p["dq_ptr"], p["dk_ptr"], p["dv_ptr"]) == (dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
    assert p["dlse_ptr"] == 0  # no gradient w.r.t. lse
    assert (p["q_batch_stride"], p["q_row_stride"], p["q_head_stride"]) == (40 * 3 * 8 * 128, 3 * 8 * 128, 128)
    assert (p["k_batch_stride"], p["k_row_stride"], p["k_head_stride"]) == (40 * 3 * 8 * 128, 3 * 8 * 128, 128)
    assert (p["do_batch_stride"], p["do_row_stride"], p["do_head_stride"]) == (40 * 8 * 128, 8 * 128, 128)
    # The gradients are fresh contiguous tensors, whatever the inputs' strides.
    assert (p["dq_batch_stride"], p["dq_row_stride"], p["dq_head_stride"]) == (40 * 8 * 128, 8 * 128, 128)
    assert (p["dk_batch_stride"], p["dk_row_stride"], p["dk_head_stride"]) == (40 * 2 * 128, 2 * 128, 128)
    assert (p["dv_batch_stride"], p["dv_row_stride"], p["dv_head_stride"]) == (40 * 2 * 128, 2 * 128, 128)
    assert all(g.is_contiguous() and g.shape == x.shape and g.dtype == x.dtype for g, x in zip((dq, dk, dv), (q, k, v)))
    sizes = (p["batch"], p["seqlen_q"], p["seqlen_k"], p["nheads_q"], p["nheads_kv"], p["headdim"], p["headdim_v"])
    assert sizes == (2, 40, 40, 8, 2, 128, 128)
    assert p["deterministic"] is True and p["softmax_scale"] == 0.3
    assert (p["window_left"], p["window_right"]) == (-1, -1)
    assert "causal" not in p and "dtype" not in p
    # The workspace: asked for with every other field already filled, then allocated at that size.
    (queried, q_index), = c.workspace_queries
    assert q_index == index and queried["workspace"] == 0
    assert {**queried, "workspace": None} == {**p, "workspace": None}
    assert allocations == [((c.workspace_bytes,), torch.uint8)]
    assert p["workspace"] != 0
    assert p["max_smem_bytes"] == 0  # the device's limit picks the sm80 tiles


def test_bwd_passes_dlse(fake: FakeC) -> None:
    dout, q, k, v, out, lse = bwd_inputs(1, 16, 24, 4, 4, 64)
    dlse = torch.randn_like(lse)
    bwd_op(dout, q, k, v, out, lse, dlse)
    p = fake.bwd_calls[0][0]
    assert p["dlse_ptr"] == dlse.data_ptr() != 0 and p["deterministic"] is False
    assert fake.key_of("bwd", fake.bwd_calls[0][1]).mask == "none"


def test_bwd_params_object_is_reused(fake: FakeC) -> None:
    args = bwd_inputs(1, 16, 16, 2, 2, 64, torch.float16)
    bwd_op(*args, None)
    first = _launch.params("BwdParams")
    bwd_op(*args, torch.randn_like(args[-1]), causal=True, deterministic=True, scale=0.2)
    assert _launch.params("BwdParams") is first and len(fake.bwd_calls) == 2
    assert fake.key_of("bwd", fake.bwd_calls[1][1]) == KernelKey(90, "float16", 64, 64, "causal")
    assert fake.bwd_calls[0][0]["dlse_ptr"] == 0 != fake.bwd_calls[1][0]["dlse_ptr"]


@pytest.mark.parametrize("shape", [(0, 16, 16, 2, 2), (2, 0, 16, 2, 2), (2, 16, 0, 2, 2), (2, 16, 16, 0, 0),
                                   (2, 0, 0, 2, 1)])
def test_bwd_empty_shapes_reach_the_launcher(fake: FakeC, allocations: list[Any], shape: tuple[int, ...]) -> None:
    # No queries or no keys: the launcher writes the zero gradients itself (dk, dv from the kernel with
    # no query rows; dq from the dQ postprocess with no keys), so the launch happens, with a workspace.
    dout, q, k, v, out, lse = bwd_inputs(*shape, 64)
    dq, dk, dv = bwd_op(dout, q, k, v, out, lse, None, causal=True)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    (p, _, _), = fake.bwd_calls
    assert (p["batch"], p["seqlen_q"], p["seqlen_k"], p["nheads_q"], p["nheads_kv"]) == shape
    assert len(allocations) == 1 and p["workspace"] != 0


def test_bwd_into_returns_the_ctas(fake: FakeC, monkeypatch: pytest.MonkeyPatch) -> None:
    dout, q, k, v, out, lse = bwd_inputs(1, 16, 16, 2, 2, 64)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    fake.ctas = 5
    grads = [torch.empty_like(x) for x in (q, k, v)]
    assert ops.bwd_into(dout, q, k, v, out, lse, *grads, 0.1, True, False, 80, window=(8, -1)) == 5
    assert fake.key_of("bwd", fake.bwd_calls[0][1]) == KernelKey(80, "bfloat16", 64, 64, "window")
    assert (fake.bwd_calls[0][0]["window_left"], fake.bwd_calls[0][0]["window_right"]) == (8, 0)


@pytest.mark.parametrize("bad", ["dout misaligned", "dout broadcast", "out strided", "lse strided", "dlse dtype"])
def test_bwd_layout_checked_before_launch(fake: FakeC, bad: str) -> None:
    dout, q, k, v, out, lse = bwd_inputs(2, 16, 16, 2, 2, 64)
    dlse = None
    if bad == "dout misaligned":
        dout = torch.randn(2 * 16 * 2 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 16, 2, 64)
    elif bad == "dout broadcast":
        dout = torch.ones(1, 1, 1, 1, dtype=torch.bfloat16).expand(2, 16, 2, 64)
    elif bad == "out strided":
        out = torch.randn(2, 16, 2, 65, dtype=torch.bfloat16)[..., :64]
    elif bad == "lse strided":
        lse = torch.randn(2, 16, 2).transpose(1, 2)
    else:
        dlse = torch.randn(2, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"^{bad.split()[0]}\b"):
        bwd_op(dout, q, k, v, out, lse, dlse)
    assert fake.bwd_calls == [] and fake.workspace_queries == []


def test_bwd_unknown_backend(fake: FakeC) -> None:
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        bwd_op(*bwd_inputs(1, 4, 4, 2, 2, 64), None, backend="triton")


def test_autograd_reaches_the_kernel(fake: FakeC) -> None:
    # Through the fwd op's autograd formula: the forward's backend, scale, mask (causal and window)
    # and deterministic reach the backward launch; out.sum()'s stride-0 gradient is made dense first;
    # an unused lse means no dlse.
    q, k, v = (x.requires_grad_() for x in randn_qkv(2, 16, 24, 4, 2, 64, torch.bfloat16))
    out, lse = fwd_op(q, k, v, 0.25, True, "sm90", (7, -1), deterministic=True)
    (out.float().sum() * 1).backward()
    (p, index, _), = fake.bwd_calls
    assert fake.key_of("bwd", index) == KernelKey(90, "bfloat16", 64, 64, "window")
    assert p["softmax_scale"] == 0.25 and (p["window_left"], p["window_right"]) == (7, 0)
    assert p["deterministic"] is True and p["dlse_ptr"] == 0
    assert (p["do_batch_stride"], p["do_row_stride"], p["do_head_stride"]) == (16 * 4 * 64, 4 * 64, 64)
    assert p["o_ptr"] == out.data_ptr() and p["lse_ptr"] == lse.data_ptr()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in (q, k, v))


def test_autograd_passes_dlse_when_lse_is_used(fake: FakeC) -> None:
    q, k, v = (x.requires_grad_() for x in randn_qkv(1, 16, 16, 2, 2, 64, torch.bfloat16))
    out, lse = fwd_op(q, k, v, 0.25, False, "sm90")
    lse.sum().backward()  # stride-0 dlse, and no gradient for out at all
    (p, _, _), = fake.bwd_calls
    assert p["dlse_ptr"] != 0 and p["do_ptr"] != 0 and p["do_row_stride"] == 2 * 64
