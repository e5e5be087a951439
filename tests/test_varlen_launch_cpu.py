"""The packed forward's prepared launch (varlen.VarlenLaunch) against its binding's declaration, without a GPU: the
extension is replaced by a recorder naming each positional argument by cpp/bindings.cpp's py::arg list of
fwd_varlen_with. The kernels and the fast path's results: tests/test_varlen_gpu.py, tests/test_plans_gpu.py."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import declared_args

from flashhopper import _ext, _launch, varlen


class Recorder:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def varlen_workspace_bytes(self, batch: int) -> int:
        return 1000 + batch

    def fwd_varlen_with(self, *args: Any) -> int:
        names = declared_args("fwd_varlen_with")
        assert len(args) == len(names), f"{len(args)} arguments, the binding declares {len(names)}"
        self.calls.append(dict(zip(names, args)))
        return 3


@pytest.mark.parametrize("arch", [90, 80])
def test_varlen_launch_arguments(monkeypatch: pytest.MonkeyPatch, arch: int) -> None:
    r = Recorder()
    counter = torch.zeros(1, dtype=torch.int32)
    monkeypatch.setattr(_ext, "extension", lambda: r)
    monkeypatch.setattr(_launch, "stream", lambda device: 77)
    monkeypatch.setattr(_launch, "tile_counter", lambda device, stream: counter)
    params = SimpleNamespace(marker=1)
    launch = varlen.VarlenLaunch(params, 5, arch, 3, torch.device("cpu"))
    assert launch.fwd(11, 12, 13, 14, 15, 16, 17, 18, 19, 20) == 3
    (a,) = r.calls
    assert a["params"] is params and (a["index"], a["stream"]) == (5, 77)
    assert [a[n] for n in ("q", "k", "v", "o", "lse", "sinks")] == [11, 12, 13, 14, 15, 16]
    assert [a[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")] == [17, 18, 19, 20]
    # Hopper: a workspace of the batch's size and the tile counter; Ampere: neither.
    assert (a["tile_counter"] == counter.data_ptr()) == (arch == 90) and (a["varlen_workspace"] != 0) == (arch == 90)
    if arch == 80:
        assert a["tile_counter"] == 0 and a["varlen_workspace"] == 0
