"""The launch plumbing of ops.py (params, stream, early exits), with the extension replaced by a
recorder so that it runs without a GPU. Kernels themselves (and _C.fwd's device switch): test_fwd_gpu.py."""
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

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], int, int]] = []

    def fwd(self, params: FwdParams, arch: int, stream: int) -> None:
        self.calls.append((dict(vars(params)), arch, stream))


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
    out, lse = torch.ops.flashhopper.fwd.default(q, k, v, 0.3, True, "sm80")
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
    torch.ops.flashhopper.fwd.default(q, k, v, 0.1, False, "sm90")
    assert c.calls[0][0]["tile_counter"] == 0


def test_params_object_is_reused(fake: FakeC) -> None:
    c = fake
    q, k, v = randn_qkv(1, 16, 16, 2, 2, 64, torch.float16)
    torch.ops.flashhopper.fwd.default(q, k, v, 0.1, False, "sm90")
    first = ops._local.params
    torch.ops.flashhopper.fwd.default(q, k, v, 0.2, True, "sm90")
    assert ops._local.params is first and len(c.calls) == 2
    assert c.calls[1][0]["causal"] is True and c.calls[1][0]["dtype"] == "fp16"


def test_no_launch_for_empty_or_keyless(fake: FakeC) -> None:
    c = fake
    q, k, v = randn_qkv(0, 16, 16, 2, 2, 64, torch.bfloat16)
    assert torch.ops.flashhopper.fwd.default(q, k, v, 0.1, False, "sm90")[0].shape == q.shape
    q, k, v = randn_qkv(2, 16, 0, 2, 2, 64, torch.bfloat16)
    out, lse = torch.ops.flashhopper.fwd.default(q, k, v, 0.1, True, "sm90")
    assert (out == 0).all() and torch.isneginf(lse).all()
    assert c.calls == []


def test_layout_checked_before_launch(fake: FakeC) -> None:
    c = fake
    q, k, v = randn_qkv(2, 16, 16, 2, 2, 64, torch.bfloat16)
    k = torch.randn(2, 16, 2, 65, dtype=torch.bfloat16)[..., :64]  # row stride 130 elements = 260 bytes
    with pytest.raises(ValueError, match=r"^k row stride"):
        torch.ops.flashhopper.fwd.default(q, k, v, 0.1, False, "sm90")
    assert c.calls == []
