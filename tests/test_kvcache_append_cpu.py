"""The append kernels' arguments (kvcache._AppendLaunch) against their bindings' declarations, without a GPU: the
extension is replaced by a recorder that names each positional argument by cpp/bindings.cpp's py::arg list, so an
argument order that drifts from the C++ side fails here. The kernels themselves: tests/test_kvcache_gpu.py,
tests/test_kvcache_fp8_gpu.py (bytes and scales against quantize_rows)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import declared_args

from flashhopper import _ext, _launch, kvcache, kvcache_fp8


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        if name not in ("kvcache_append", "kvcache_append_fp8"):
            raise AttributeError(name)

        def call(*args: Any) -> int:
            names = declared_args(name)
            assert len(args) == len(names), f"{name}: {len(args)} arguments, the binding declares {len(names)}"
            self.calls.append((name, dict(zip(names, args))))
            return 1
        return call


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    r = Recorder()
    monkeypatch.setattr(_ext, "extension", lambda: r)
    monkeypatch.setattr(_launch, "stream", lambda device: 1234)
    return r


@pytest.mark.parametrize("paged", [False, True])
def test_append_arguments(recorder: Recorder, paged: bool) -> None:
    kc = torch.zeros(6, 32, 2, 64, dtype=torch.bfloat16)
    vc = torch.zeros(6, 32, 2, 64, dtype=torch.bfloat16)
    k = torch.zeros(3, 4, 2, 64, dtype=torch.bfloat16)
    v = torch.zeros(3, 4, 2, 64, dtype=torch.bfloat16)
    lens = torch.tensor([0, 5, 9], dtype=torch.int32)
    table = torch.tensor([[1, 2], [3, 4], [5, 0]], dtype=torch.int32) if paged else None
    kvcache._launch_append(kc, vc, k, v, lens, 0, table, None)
    ((name, a),) = recorder.calls
    assert name == "kvcache_append"
    assert (a["stream"], a["device"]) == (1234, k.device.index)
    assert (a["k_cache"], a["v_cache"], a["k"], a["v"]) == (kc.data_ptr(), vc.data_ptr(), k.data_ptr(), v.data_ptr())
    assert a["k_cache_strides"] == [32 * 2 * 64 * 2, 2 * 64 * 2, 64 * 2] == a["v_cache_strides"]
    assert a["k_strides"] == [4 * 2 * 64 * 2, 2 * 64 * 2, 64 * 2] == a["v_strides"]
    assert (a["cache_seqlens"], a["seqlen_offset"], a["cache_batch_idx"]) == (lens.data_ptr(), 0, 0)
    assert (a["page_table"], a["table_stride"]) == ((table.data_ptr(), 2) if paged else (0, 0))
    assert (a["page_size"], a["batch"], a["seqlen_new"], a["heads"]) == (32, 3, 4, 2)
    assert (a["k_row_bytes"], a["v_row_bytes"]) == (128, 128)


@pytest.mark.parametrize("seed", [None, -5])
def test_append_fp8_arguments(recorder: Recorder, seed: int | None) -> None:
    kc = torch.zeros(6, 16, 2, 128, dtype=kvcache_fp8.E4M3)
    vc = torch.zeros(6, 16, 2, 128, dtype=kvcache_fp8.E4M3)
    ks = torch.zeros(6, 2, 16)
    vs = torch.zeros(6, 2, 16)
    k = torch.zeros(2, 1, 2, 128, dtype=torch.float16)
    v = torch.zeros(2, 1, 2, 128, dtype=torch.float16)
    kvcache._launch_append_fp8(kc, vc, ks, vs, k, v, None, 7, None, torch.tensor([4, 1], dtype=torch.int32), seed)
    ((name, a),) = recorder.calls
    assert name == "kvcache_append_fp8"
    assert (a["k_cache"], a["v_cache"], a["k"], a["v"]) == (kc.data_ptr(), vc.data_ptr(), k.data_ptr(), v.data_ptr())
    assert (a["k_scale"], a["v_scale"]) == (ks.data_ptr(), vs.data_ptr())
    assert a["k_cache_strides"] == [16 * 2 * 128, 2 * 128, 128]  # bytes: e4m3
    assert a["k_strides"] == [2 * 128 * 2, 2 * 128 * 2, 128 * 2]
    assert a["k_scale_strides"] == [2 * 16, 16] == a["v_scale_strides"]  # elements
    assert (a["cache_seqlens"], a["seqlen_offset"], a["page_table"], a["table_stride"]) == (0, 7, 0, 0)
    assert a["cache_batch_idx"] != 0
    assert (a["page_size"], a["batch"], a["seqlen_new"], a["heads"], a["headdim"]) == (16, 2, 1, 2, 128)
    assert a["src_bf16"] is False
    assert (a["hadamard_k"], a["hadamard_seed"]) == ((False, 0) if seed is None else (True, -5))


def test_plan_append_runs_the_same_arguments(recorder: Recorder) -> None:
    # The eager plan's prepared call (_AppendLaunch made once, run with each call's tensors) gives what a fresh one does.
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    k, v = torch.zeros(2, 1, 2, 64, dtype=torch.bfloat16), torch.zeros(2, 1, 2, 64, dtype=torch.bfloat16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    prepared = kvcache._append_launch(kc, vc, k, v, table)
    k2, v2 = torch.ones_like(k), torch.ones_like(v)
    lens = torch.tensor([3, 17], dtype=torch.int32)
    prepared.run(kc, vc, k2, v2, lens, 0, table, None)
    kvcache._launch_append(kc, vc, k2, v2, lens, 0, table, None)
    assert recorder.calls[0] == recorder.calls[1]
