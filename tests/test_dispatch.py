"""Backend choice, as a pure function of the device, the build and the call (no GPU needed)."""
from __future__ import annotations

import pytest
import torch

from flashhopper import available_backends, dispatch
from flashhopper._device import DeviceInfo
from flashhopper.dispatch import choose_kernel, runs_on, select_backend

H100 = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132)
A100 = DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108)
L40S = DeviceInfo("NVIDIA L40S", (8, 9), 142)
B200 = DeviceInfo("NVIDIA B200", (10, 0), 148)
T4 = DeviceInfo("Tesla T4", (7, 5), 40)
BF16 = torch.bfloat16


def build(*archs: int, dtype: torch.dtype = BF16, headdim: int = 128) -> set[dispatch.KernelKey]:
    return {(a, dtype, headdim, c) for a in archs for c in (False, True)}


def choose(info: DeviceInfo, kernels: set[dispatch.KernelKey], backend: str | None = None,
           dtype: torch.dtype = BF16, headdim: int = 128, causal: bool = False) -> str:
    return choose_kernel(info, 0, dtype, headdim, causal, backend, kernels)


def test_runs_on() -> None:
    assert runs_on("sm90", (9, 0))
    assert not runs_on("sm90", (8, 0)) and not runs_on("sm90", (10, 0))
    assert all(runs_on("sm80", c) for c in [(8, 0), (8, 6), (8, 9), (9, 0)])
    assert not runs_on("sm80", (7, 5)) and not runs_on("sm80", (10, 0))
    assert not runs_on("reference", (9, 0))  # not a kernel family


def test_auto_prefers_sm90_on_hopper() -> None:
    assert choose(H100, build(90, 80)) == "sm90"
    assert choose(H100, build(80)) == "sm80"


def test_auto_per_configuration() -> None:
    # sm90 has only non-causal compiled: a causal call falls to sm80, a non-causal one stays.
    kernels = {(90, BF16, 128, False)} | build(80)
    assert choose(H100, kernels, causal=False) == "sm90"
    assert choose(H100, kernels, causal=True) == "sm80"


def test_auto_on_ampere_and_ada() -> None:
    assert choose(A100, build(90, 80)) == "sm80"
    assert choose(L40S, build(80)) == "sm80"
    with pytest.raises(ValueError, match=r"^q: this build has no sm80 kernel .*FLASHHOPPER_ARCHS=80"):
        choose(A100, build(90))


def test_auto_missing_kernel_says_what_to_build() -> None:
    with pytest.raises(ValueError) as e:
        choose(H100, build(90, 80, headdim=64), dtype=torch.float16, headdim=256, causal=True)
    msg = str(e.value)
    assert msg.startswith("q: this build has no sm90 or sm80 kernel for float16 headdim 256 causal")
    assert "FLASHHOPPER_ARCHS=90;80 FLASHHOPPER_DTYPES=fp16 FLASHHOPPER_HDIMS=256" in msg
    assert "backend='reference'" in msg


def test_unsupported_gpus() -> None:
    with pytest.raises(ValueError, match=r"^q is on cuda:0 \(Tesla T4, compute capability 7\.5\).*8\.0"):
        choose(T4, build(90, 80))
    with pytest.raises(ValueError, match=r"^q is on .*B200.*no flashhopper kernel family"):
        choose(B200, build(90, 80))


def test_forced_backends() -> None:
    assert choose(H100, build(90, 80), backend="sm80") == "sm80"
    assert choose(H100, build(90, 80), backend="sm90") == "sm90"
    with pytest.raises(ValueError, match=r"^backend='sm90' needs compute capability 9\.0"):
        choose(A100, build(90, 80), backend="sm90")
    with pytest.raises(ValueError, match=r"^backend='sm80': this build has no sm80 kernel .*FLASHHOPPER_ARCHS=80"):
        choose(H100, build(90), backend="sm80")


def test_kernel_inputs_checked_first() -> None:
    with pytest.raises(TypeError, match=r"^q has dtype torch.float32"):
        choose(H100, build(90), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^q head dim 96"):
        choose(H100, build(90), headdim=96)


def test_select_backend_on_cpu() -> None:
    q = torch.randn(1, 4, 2, 64)
    assert select_backend(q, 64, q.dtype, False) == "reference"
    assert select_backend(q, 64, q.dtype, False, "reference") == "reference"
    for backend in ("sm90", "sm80"):
        with pytest.raises(ValueError, match=rf"^backend='{backend}' needs CUDA tensors"):
            select_backend(q, 64, q.dtype, False, backend)
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        select_backend(q, 64, q.dtype, False, "triton")


def test_available_backends() -> None:
    backends = available_backends("cpu")
    assert backends == ["reference"]
    assert available_backends()[-1] == "reference"
    assert set(available_backends()) <= set(dispatch.BACKENDS)


def test_missing_bwd_kernel() -> None:
    kernels = build(90)  # bf16 headdim 128, causal and not
    assert dispatch.missing_bwd_kernel("sm90", BF16, 128, True, kernels) == ""
    assert dispatch.missing_bwd_kernel("reference", torch.float32, 96, True, set()) == ""  # needs no kernel
    msg = dispatch.missing_bwd_kernel("sm90", torch.float16, 256, False, kernels)
    assert msg.startswith("this build has no sm90 backward kernel for float16 headdim 256 non-causal; ")
    assert "FLASHHOPPER_ARCHS=90 FLASHHOPPER_MODES=fwd;bwd FLASHHOPPER_DTYPES=fp16 FLASHHOPPER_HDIMS=256" in msg
    msg = dispatch.missing_bwd_kernel("sm80", BF16, 128, True, kernels)
    assert "no sm80 backward kernel" in msg and "FLASHHOPPER_ARCHS=80 FLASHHOPPER_MODES=fwd;bwd" in msg


def test_require_bwd_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    built: set[dispatch.KernelKey] = {(90, BF16, 128, True)}
    monkeypatch.setattr(dispatch._ext, "has_bwd_kernel", lambda *key: key in built)
    q, k, v = (torch.randn(1, 4, 2, 128, dtype=BF16) for _ in range(3))
    dispatch.require_bwd_kernel("sm90", q, k, v, 128, False)  # nothing requires grad
    v.requires_grad_()
    dispatch.require_bwd_kernel("sm90", q, k, v, 128, True)  # built
    with pytest.raises(ValueError, match=r"^v requires grad, but this build has no sm90 backward kernel"):
        dispatch.require_bwd_kernel("sm90", q, k, v, 128, False)
    with torch.no_grad():
        dispatch.require_bwd_kernel("sm90", q, k, v, 128, False)  # no gradient will be asked for
    k.requires_grad_()
    with pytest.raises(ValueError, match=r"^k requires grad"):  # the first one that does
        dispatch.require_bwd_kernel("sm80", q, k, v, 128, True)


def test_compiled_kernel_views(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch._ext, "has_fwd_kernel", lambda *key: key[0] == 90)
    monkeypatch.setattr(dispatch._ext, "has_bwd_kernel", lambda *key: key[0] == 80)
    fwd, bwd = dispatch._CompiledKernels(), dispatch._CompiledKernels("bwd")
    assert (90, BF16, 128, True) in fwd and (90, BF16, 128, True) not in bwd
    assert (80, BF16, 128, True) in bwd and (80, BF16, 128, True) not in fwd
    assert "not a key" not in fwd
