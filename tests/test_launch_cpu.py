"""The launch plumbing of ops.py (params, workspace, stream, early exits), with the extension replaced
by a recorder so that it runs without a GPU. Kernels themselves (and _C.fwd/_C.bwd's device switch):
test_fwd_gpu.py, test_bwd_gpu.py."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import randn_qkv

from flashhopper import ops


class FakeC:
    DType = SimpleNamespace(float16="fp16", bfloat16="bf16")

    class FwdParams(SimpleNamespace):
        pass

    class BwdParams(SimpleNamespace):
        pass

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], int, int]] = []
        self.bwd_calls: list[tuple[dict[str, Any], int, int]] = []
        self.workspace_queries: list[tuple[dict[str, Any], int]] = []
        self.workspace_bytes = 4096 + 17

    def fwd(self, params: FwdParams, arch: int, stream: int) -> None:
        self.calls.append((dict(vars(params)), arch, stream))

    def bwd_workspace_bytes(self, params: BwdParams, arch: int) -> int:
        self.workspace_queries.append((dict(vars(params)), arch))
        return self.workspace_bytes

    def bwd(self, params: BwdParams, arch: int, stream: int) -> None:
        self.bwd_calls.append((dict(vars(params)), arch, stream))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeC]:
    c = FakeC()
    monkeypatch.setattr(ops._ext, "extension", lambda: c)
    monkeypatch.setattr(ops, "_c_dtypes", {})
    monkeypatch.setattr(ops, "_local", threading.local())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: SimpleNamespace(cuda_stream=4242))
    # CPU stand-ins for the per-stream tile counters.
    monkeypatch.setattr(ops, "_tile_counters", {})  # keyed (None, stream) here: CPU tensors have no index
    monkeypatch.setattr(ops, "tile_counter", lambda index, stream: ops._tile_counters.setdefault(
        (index, stream), torch.zeros(1, dtype=torch.int32)))
    yield c


def test_op_launches_the_arch_on_the_current_stream(fake: FakeC) -> None:
    c = fake
    q, k, v = randn_qkv(2, 40, 56, 8, 2, 128, torch.bfloat16)
    out, lse = torch.ops.flashhopper.fwd.default(q, k, v, 0.3, True, False, "sm80")
    assert len(c.calls) == 1
    p, arch, stream = c.calls[0]
    assert arch == 80 and stream == 4242
    assert p["q_ptr"] == q.data_ptr() and p["o_ptr"] == out.data_ptr() and p["lse_ptr"] == lse.data_ptr()
    assert (p["seqlen_q"], p["seqlen_k"], p["nheads_q"], p["nheads_kv"]) == (40, 56, 8, 2)
    assert p["causal"] is True and p["softmax_scale"] == 0.3 and p["dtype"] == "bf16"
    assert p["tile_counter"] == ops._tile_counters[(None, 4242)].data_ptr() != 0  # type: ignore[index]


def test_non_causal_passes_no_tile_counter(fake: FakeC) -> None:
    c = fake
    q, k, v = randn_qkv(1, 16, 16, 2, 2, 64, torch.bfloat16)
    torch.ops.flashhopper.fwd.default(q, k, v, 0.1, False, False, "sm90")
    assert c.calls[0][0]["tile_counter"] == 0


def test_params_object_is_reused(fake: FakeC) -> None:
    c = fake
    q, k, v = randn_qkv(1, 16, 16, 2, 2, 64, torch.float16)
    torch.ops.flashhopper.fwd.default(q, k, v, 0.1, False, False, "sm90")
    first = ops._local.params
    torch.ops.flashhopper.fwd.default(q, k, v, 0.2, True, False, "sm90")
    assert ops._local.params is first and len(c.calls) == 2
    assert c.calls[1][0]["causal"] is True and c.calls[1][0]["dtype"] == "fp16"


def test_no_launch_for_empty_or_keyless(fake: FakeC) -> None:
    c = fake
    q, k, v = randn_qkv(0, 16, 16, 2, 2, 64, torch.bfloat16)
    assert torch.ops.flashhopper.fwd.default(q, k, v, 0.1, False, False, "sm90")[0].shape == q.shape
    q, k, v = randn_qkv(2, 16, 0, 2, 2, 64, torch.bfloat16)
    out, lse = torch.ops.flashhopper.fwd.default(q, k, v, 0.1, True, False, "sm90")
    assert (out == 0).all() and torch.isneginf(lse).all()
    assert c.calls == []


def test_layout_checked_before_launch(fake: FakeC) -> None:
    c = fake
    q, k, v = randn_qkv(2, 16, 16, 2, 2, 64, torch.bfloat16)
    k = torch.randn(2, 16, 2, 65, dtype=torch.bfloat16)[..., :64]  # row stride 130 elements = 260 bytes
    with pytest.raises(ValueError, match=r"^k row stride"):
        torch.ops.flashhopper.fwd.default(q, k, v, 0.1, False, False, "sm90")
    assert c.calls == []


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


def test_bwd_launches_the_arch_on_the_current_stream(fake: FakeC, allocations: list[Any]) -> None:
    c = fake
    qkv = torch.randn(2, 40, 3, 8, 128, dtype=torch.bfloat16)  # packed: strided q, and GQA k, v
    q, k, v = qkv[:, :, 0], qkv[:, :, 1, :2], qkv[:, :, 2, :2]
    dout, out, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(2, 8, 40)
    dq, dk, dv = torch.ops.flashhopper.bwd.default(dout, q, k, v, out, lse, None, 0.3, True, True, "sm80")
    assert len(c.bwd_calls) == 1 and c.calls == []
    p, arch, stream = c.bwd_calls[0]
    assert arch == 80 and stream == 4242
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
    sizes = (p["batch"], p["seqlen_q"], p["seqlen_k"], p["nheads_q"], p["nheads_kv"], p["headdim"])
    assert sizes == (2, 40, 40, 8, 2, 128)
    assert p["causal"] is True and p["deterministic"] is True and p["softmax_scale"] == 0.3 and p["dtype"] == "bf16"
    # The workspace: asked for with every other field already filled, then allocated at that size.
    (queried, q_arch), = c.workspace_queries
    assert q_arch == 80 and queried["workspace"] == 0
    assert {**queried, "workspace": None} == {**p, "workspace": None}
    assert allocations == [((c.workspace_bytes,), torch.uint8)]
    assert p["workspace"] != 0
    assert p["max_smem_bytes"] == 0  # the device's limit picks the sm80 tiles


def test_bwd_passes_dlse(fake: FakeC) -> None:
    dout, q, k, v, out, lse = bwd_inputs(1, 16, 24, 4, 4, 64)
    dlse = torch.randn_like(lse)
    torch.ops.flashhopper.bwd.default(dout, q, k, v, out, lse, dlse, 0.1, False, False, "sm90")
    p = fake.bwd_calls[0][0]
    assert p["dlse_ptr"] == dlse.data_ptr() != 0 and p["deterministic"] is False and p["causal"] is False


def test_bwd_without_workspace(fake: FakeC, allocations: list[Any]) -> None:
    fake.workspace_bytes = 0
    torch.ops.flashhopper.bwd.default(*bwd_inputs(1, 16, 16, 2, 2, 64), None, 0.1, False, False, "sm90")
    assert fake.bwd_calls[0][0]["workspace"] == 0 and allocations == []


def test_bwd_params_object_is_reused(fake: FakeC) -> None:
    args = bwd_inputs(1, 16, 16, 2, 2, 64, torch.float16)
    torch.ops.flashhopper.bwd.default(*args, None, 0.1, False, False, "sm90")
    first = ops._local.bwd_params
    torch.ops.flashhopper.bwd.default(*args, torch.randn_like(args[-1]), 0.2, True, True, "sm90")
    assert ops._local.bwd_params is first and len(fake.bwd_calls) == 2
    assert fake.bwd_calls[1][0]["causal"] is True and fake.bwd_calls[1][0]["dtype"] == "fp16"
    assert fake.bwd_calls[0][0]["dlse_ptr"] == 0 != fake.bwd_calls[1][0]["dlse_ptr"]


@pytest.mark.parametrize("shape", [(0, 16, 16, 2, 2), (2, 0, 16, 2, 2), (2, 16, 0, 2, 2), (2, 16, 16, 0, 0),
                                   (2, 0, 0, 2, 1)])
def test_bwd_no_launch_for_empty_shapes(fake: FakeC, allocations: list[Any], shape: tuple[int, ...]) -> None:
    # No queries or no keys: every gradient is an empty sum. The real ones must be zeros, not garbage.
    dout, q, k, v, out, lse = bwd_inputs(*shape, 64)
    dq, dk, dv = torch.ops.flashhopper.bwd.default(dout, q, k, v, out, lse, None, 0.1, True, False, "sm90")
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()
    assert fake.bwd_calls == [] and fake.workspace_queries == [] and allocations == []


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
        torch.ops.flashhopper.bwd.default(dout, q, k, v, out, lse, dlse, 0.1, False, False, "sm90")
    assert fake.bwd_calls == [] and fake.workspace_queries == []


def test_bwd_unknown_backend(fake: FakeC) -> None:
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        torch.ops.flashhopper.bwd.default(*bwd_inputs(1, 4, 4, 2, 2, 64), None, 0.1, False, False, "triton")


def test_autograd_reaches_the_kernel(fake: FakeC) -> None:
    # Through the fwd op's autograd formula: the forward's backend, scale, causal and deterministic
    # reach the backward launch; out.sum()'s stride-0 gradient is made dense first; an unused lse
    # means no dlse.
    q, k, v = (x.requires_grad_() for x in randn_qkv(2, 16, 24, 4, 2, 64, torch.bfloat16))
    out, lse = torch.ops.flashhopper.fwd.default(q, k, v, 0.25, True, True, "sm90")
    (out.float().sum() * 1).backward()
    (p, arch, _), = fake.bwd_calls
    assert arch == 90 and p["softmax_scale"] == 0.25 and p["causal"] is True and p["deterministic"] is True
    assert p["dlse_ptr"] == 0
    assert (p["do_batch_stride"], p["do_row_stride"], p["do_head_stride"]) == (16 * 4 * 64, 4 * 64, 64)
    assert p["o_ptr"] == out.data_ptr() and p["lse_ptr"] == lse.data_ptr()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in (q, k, v))


def test_autograd_passes_dlse_when_lse_is_used(fake: FakeC) -> None:
    q, k, v = (x.requires_grad_() for x in randn_qkv(1, 16, 16, 2, 2, 64, torch.bfloat16))
    out, lse = torch.ops.flashhopper.fwd.default(q, k, v, 0.25, False, False, "sm90")
    lse.sum().backward()  # stride-0 dlse, and no gradient for out at all
    (p, _, _), = fake.bwd_calls
    assert p["dlse_ptr"] != 0 and p["do_ptr"] != 0 and p["do_row_stride"] == 2 * 64
