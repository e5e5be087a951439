"""Backend choice, as a pure function of the device, the build and the call (no GPU needed)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import helpers
import pytest
import torch

from flashhopper import _device, _ext, available_backends, dispatch
from flashhopper._device import DeviceInfo
from flashhopper.dispatch import choose_kernel, kernel_key, resolve_backend, runs_on, select_backend
from flashhopper.kernel_key import KernelKey

H100 = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 132)
A100 = DeviceInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108)
L40S = DeviceInfo("NVIDIA L40S", (8, 9), 142)
B200 = DeviceInfo("NVIDIA B200", (10, 0), 148)
T4 = DeviceInfo("Tesla T4", (7, 5), 40)
BF16 = torch.bfloat16


def build(*archs: int, dtype: str = "bfloat16", headdim: int = 128,
          masks: tuple[str, ...] = ("none", "causal")) -> set[KernelKey]:
    return {KernelKey(a, dtype, headdim, headdim, m) for a in archs for m in masks}


def choose(info: DeviceInfo, kernels: set[KernelKey], backend: str | None = None, dtype: torch.dtype = BF16,
           headdim: int = 128, mask: str = "none") -> str:
    return choose_kernel(info, 0, dtype, headdim, mask, backend, kernels)


def test_kernel_key() -> None:
    assert kernel_key("sm90", BF16, 128, False) == KernelKey(90, "bfloat16", 128, 128, "none")
    assert kernel_key("sm80", torch.float16, 64, True) == KernelKey(80, "float16", 64, 64, "causal")
    # A window makes the mask "window", causal or not; (-1, -1) is no window at all.
    assert kernel_key("sm90", BF16, 128, True, (128, -1)).mask == "window"
    assert kernel_key("sm90", BF16, 128, False, (-1, 0)).mask == "window"
    assert kernel_key("sm90", BF16, 128, True, (-1, -1)).mask == "causal"
    assert kernel_key("sm90", BF16, 128, False, (-1, -1)).mask == "none"
    assert kernel_key("sm90", BF16, 128, False, variant="no-pingpong").variant == "no-pingpong"
    assert kernel_key("sm90", torch.float8_e4m3fn, 128, True).dtype == "float8_e4m3fn"  # the fp8 forward's
    with pytest.raises(ValueError, match=r"^backend must be one of 'sm90', 'sm80'"):
        kernel_key("reference", BF16, 128, False)


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
    kernels = build(90, masks=("none",)) | build(80)
    assert choose(H100, kernels, mask="none") == "sm90"
    assert choose(H100, kernels, mask="causal") == "sm80"
    # The window kernels are their own keys: a build with causal only has none.
    assert choose(H100, kernels | build(80, masks=("window",)), mask="window") == "sm80"


def test_auto_on_ampere_and_ada() -> None:
    assert choose(A100, build(90, 80)) == "sm80"
    assert choose(L40S, build(80)) == "sm80"
    with pytest.raises(ValueError, match=r"^q: this build has no sm80 kernel .*FLASHHOPPER_ARCHS=80"):
        choose(A100, build(90))


def test_auto_missing_kernel_says_what_to_build() -> None:
    with pytest.raises(ValueError) as e:
        choose(H100, build(90, 80, headdim=64), dtype=torch.float16, headdim=256, mask="causal")
    msg = str(e.value)
    assert msg.startswith("q: this build has no sm90 or sm80 kernel for float16 headdim 256 causal")
    assert "FLASHHOPPER_ARCHS=90;80 FLASHHOPPER_DTYPES=fp16 FLASHHOPPER_HDIMS=256 (or a superset)" in msg
    assert "backend='reference'" in msg


def test_missing_window_kernel_says_to_configure_the_mask() -> None:
    with pytest.raises(ValueError) as e:
        choose(H100, build(90), mask="window")
    msg = str(e.value)
    assert msg.startswith("q: this build has no sm90 or sm80 kernel for bfloat16 headdim 128 windowed")
    assert "FLASHHOPPER_HDIMS=128 FLASHHOPPER_MASKS=none;causal;window" in msg


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


def test_variants_are_never_chosen() -> None:
    # An ablation variant is a kernel of its own key: a build with only the variant has no production kernel.
    variant_only = {KernelKey(90, "bfloat16", 128, 128, "none", "no-pingpong")}
    with pytest.raises(ValueError, match=r"^q: this build has no sm90"):
        choose(H100, variant_only)


def test_kernel_inputs_checked_first() -> None:
    with pytest.raises(TypeError, match=r"^q has dtype torch.float32"):
        choose(H100, build(90), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^q head dim 80"):
        choose(H100, build(90), headdim=80)


def test_select_backend_on_cpu() -> None:
    q = torch.randn(1, 4, 2, 64)
    assert select_backend(q, 64, q.dtype, False) == "reference"
    assert select_backend(q, 64, q.dtype, False, "reference") == "reference"
    assert select_backend(q, 64, q.dtype, True, window=(3, 0)) == "reference"
    for backend in ("sm90", "sm80"):
        with pytest.raises(ValueError, match=rf"^backend='{backend}' needs CUDA tensors"):
            select_backend(q, 64, q.dtype, False, backend)
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        select_backend(q, 64, q.dtype, False, "triton")
    with pytest.raises(ValueError, match=r"^window"):
        select_backend(q, 64, q.dtype, False, window=(-2, 0))


def test_select_backend_on_cuda_passes_the_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    # A pretend H100 whose build has only sm80 window kernels: the window reaches the key.
    monkeypatch.setattr(_device, "device_info", lambda index: H100)
    kernels = build(90) | build(80, masks=("window",))
    monkeypatch.setattr(_ext, "has_kernel", lambda mode, key: mode == "fwd" and key in kernels)
    q: Any = SimpleNamespace(device=torch.device("cuda", 0))  # all select_backend reads of q
    assert resolve_backend(q, 128, BF16, True) == "sm90"
    assert resolve_backend(q, 128, BF16, True, window=(64, -1)) == "sm80"
    assert resolve_backend(q, 128, BF16, False, window=(-1, -1)) == "sm90"


def test_available_backends() -> None:
    backends = available_backends("cpu")
    assert backends == ["reference"]
    assert available_backends()[-1] == "reference"
    assert set(available_backends()) <= set(dispatch.BACKENDS)


def test_missing_bwd_kernel() -> None:
    kernels = build(90)  # bf16 headdim 128, masks none and causal
    assert dispatch.missing_bwd_kernel("sm90", BF16, 128, True, kernels) == ""
    assert dispatch.missing_bwd_kernel("sm90", BF16, 128, True, kernels, window=(-1, -1)) == ""
    assert dispatch.missing_bwd_kernel("reference", torch.float32, 96, True, set()) == ""  # needs no kernel
    msg = dispatch.missing_bwd_kernel("sm90", torch.float16, 256, False, kernels)
    assert msg.startswith("this build has no sm90 backward kernel for float16 headdim 256 non-causal; ")
    assert "FLASHHOPPER_ARCHS=90 FLASHHOPPER_MODES=fwd;bwd FLASHHOPPER_DTYPES=fp16 FLASHHOPPER_HDIMS=256" in msg
    msg = dispatch.missing_bwd_kernel("sm80", BF16, 128, True, kernels)
    assert "no sm80 backward kernel" in msg and "FLASHHOPPER_ARCHS=80 FLASHHOPPER_MODES=fwd;bwd" in msg
    msg = dispatch.missing_bwd_kernel("sm90", BF16, 128, True, kernels, window=(32, 0))
    assert "windowed" in msg and "FLASHHOPPER_MASKS=none;causal;window" in msg


def test_require_bwd_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    built = {KernelKey(90, "bfloat16", 128, 128, "causal")}
    monkeypatch.setattr(dispatch._ext, "has_kernel", lambda mode, key: mode == "bwd" and key in built)
    q, k, v = (torch.randn(1, 4, 2, 128, dtype=BF16) for _ in range(3))
    dispatch.require_bwd_kernel("sm90", q, k, v, 128, False)  # nothing requires grad
    v.requires_grad_()
    dispatch.require_bwd_kernel("sm90", q, k, v, 128, True)  # built
    with pytest.raises(ValueError, match=r"^v requires grad, but this build has no sm90 backward kernel"):
        dispatch.require_bwd_kernel("sm90", q, k, v, 128, False)
    with pytest.raises(ValueError, match=r"^v requires grad, .* windowed"):
        dispatch.require_bwd_kernel("sm90", q, k, v, 128, True, window=(16, 0))
    with torch.no_grad():
        dispatch.require_bwd_kernel("sm90", q, k, v, 128, False)  # no gradient will be asked for
    k.requires_grad_()
    with pytest.raises(ValueError, match=r"^k requires grad"):  # the first one that does
        dispatch.require_bwd_kernel("sm80", q, k, v, 128, True)


def test_require_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = _ext.Entry(3, 128, 128)
    key = KernelKey(90, "bfloat16", 128, 128, "causal")
    monkeypatch.setattr(_ext, "kernel", lambda mode, k: entry if (mode, k) == ("fwd", key) else None)
    monkeypatch.setattr(_ext, "extension_error", lambda: None)
    assert dispatch.require_kernel("fwd", key) == entry
    with pytest.raises(ValueError, match=r"^arch=90: this build has no sm90 backward kernel for bfloat16 headdim "
                                         r"128 causal; rebuild with FLASHHOPPER_ARCHS=90 FLASHHOPPER_MODES=fwd;bwd"):
        dispatch.require_kernel("bwd", key)
    with pytest.raises(ValueError, match=r"^arch=80: this build has no sm80 forward kernel .*FLASHHOPPER_ARCHS=80 "):
        dispatch.require_kernel("fwd", KernelKey(80, "bfloat16", 128, 128, "causal"))


def test_compiled_kernel_views(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch._ext, "has_kernel", lambda mode, key: (mode, key.arch) in (("fwd", 90), ("bwd", 80)))
    fwd, bwd = dispatch._CompiledKernels(), dispatch._CompiledKernels("bwd")
    k90, k80 = KernelKey(90, "bfloat16", 128, 128, "causal"), KernelKey(80, "bfloat16", 128, 128, "causal")
    assert k90 in fwd and k90 not in bwd
    assert k80 in bwd and k80 not in fwd
    assert "not a key" not in fwd
    assert (90, BF16, 128, True) not in fwd  # the old tuple keys are gone


def test_gpu_tests_fail_on_a_configured_missing_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # helpers.require_backend, the GPU tests' gate, on a pretend H100 and build: skip what cannot run
    # here or was not asked for, fail what was asked for and is missing, or what dispatch refuses.
    info = {"archs": [90, 80], "modes": ["fwd", "bwd"], "dtypes": ["bf16"], "headdims": [128],
            "masks": ["none", "causal"], "variants": []}
    built = {("fwd", KernelKey(a, "bfloat16", 128, 128, m)) for a in (90, 80) for m in ("none", "causal")}
    built.add(("bwd", KernelKey(90, "bfloat16", 128, 128, "causal")))  # the others are "lost"
    monkeypatch.setattr(_device, "device_info", lambda index: H100)
    monkeypatch.setattr(_ext, "build_info", lambda: info)
    monkeypatch.setattr(_ext, "kernel", lambda mode, key: _ext.Entry(0, 128, 128) if (mode, key) in built else None)
    refused: list[str] = []

    def select(q: Any, headdim: int, dtype: torch.dtype, causal: bool, backend: str | None = None, *,
               window: tuple[int, int] | None = None, softcap: float = 0.0, headdim_v: int | None = None,
               dropout: bool = False, varlen: bool = False) -> str:
        if refused:
            raise ValueError(refused[0])
        return str(backend)

    monkeypatch.setattr(dispatch, "select_backend", select)
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: None)  # no CUDA tensor on this machine

    helpers.require_backend("sm90", BF16, 128, True, mode="bwd", device="cuda:0")  # built: runs
    missing = "configured with the bwd kernel sm90 bfloat16 headdim 128 mask none,"
    with pytest.raises(pytest.fail.Exception, match=missing):
        helpers.require_backend("sm90", BF16, 128, False, mode="bwd", device="cuda:0")
    with pytest.raises(pytest.skip.Exception, match="configure FLASHHOPPER_MASKS with window"):
        helpers.require_backend("sm90", BF16, 128, True, window=(64, -1), device="cuda:0")
    with pytest.raises(pytest.skip.Exception, match="configure FLASHHOPPER_DTYPES with fp16"):
        helpers.require_backend("sm80", torch.float16, 128, True, device="cuda:0")
    with pytest.raises(pytest.skip.Exception, match="configure FLASHHOPPER_HDIMS with 64"):
        helpers.require_backend("sm80", BF16, 64, True, device="cuda:0")
    monkeypatch.setattr(_device, "device_info", lambda index: A100)
    with pytest.raises(pytest.skip.Exception, match="sm90 kernels do not run on NVIDIA A100"):
        helpers.require_backend("sm90", BF16, 128, True, device="cuda:0")
    refused.append("a dispatch bug")
    with pytest.raises(pytest.fail.Exception, match="dispatch refuses sm80 .* a dispatch bug"):
        helpers.require_backend("sm80", BF16, 128, True, device="cuda:0")



def test_headdim_pairs_dispatch() -> None:
    # (Q/K, V) head dims that differ: keyed on both, Hopper kernels only (the hint says so on an A100).
    pair = {KernelKey(90, "bfloat16", 192, 128, m) for m in ("none", "causal")}
    assert choose_kernel(H100, 0, BF16, 192, "causal", None, pair, headdim_v=128) == "sm90"
    with pytest.raises(ValueError, match=r"Hopper \(sm90\) 16-bit kernels only"):
        choose_kernel(A100, 0, BF16, 192, "none", None, pair, headdim_v=128)
    with pytest.raises(ValueError, match=r"^q/k head dim 192 with v head dim 64 is not supported"):
        choose_kernel(H100, 0, BF16, 192, "none", None, pair, headdim_v=64)
    with pytest.raises(ValueError, match=r"FLASHHOPPER_HDIMS=192x128 "):
        choose_kernel(H100, 0, BF16, 192, "none", None, build(90), headdim_v=128)


# --- kernels that no build has: the error says so, never a rebuild hint that cannot help ---

# (Q/K, V) head dims the padded-batch kernels have and the packed-batch (varlen) ones never do.
NOT_VARLEN = [(96, 96), (192, 192), (192, 128), (128, 64)]


def assert_no_build_has_it(msg: str, supported: str = "64, 128, 256") -> None:
    assert "no build has one" in msg and f"head dims {supported}" in msg, msg
    assert "rebuild" not in msg and "FLASHHOPPER_" not in msg, msg


@pytest.mark.parametrize(("d", "dv"), NOT_VARLEN)
def test_varlen_headdim_no_build_has(d: int, dv: int) -> None:
    # Whatever the build holds (nothing, or the padded-batch kernels of this head dim and the varlen ones of 128).
    full = {KernelKey(a, "bfloat16", d, dv, m) for a in (90, 80) for m in ("none", "causal")}
    full |= {KernelKey(a, "bfloat16", 128, 128, m, varlen=True) for a in (90, 80) for m in ("none", "causal")}
    for kernels in (set(), full):
        for info, backend in ((H100, None), (H100, "sm90"), (H100, "sm80"), (A100, None)):
            with pytest.raises(ValueError) as e:
                choose_kernel(info, 0, BF16, d, "causal", backend, kernels, headdim_v=dv, varlen=True)
            assert_no_build_has_it(str(e.value))
            assert "packed batches (varlen)" in str(e.value) and "flash_attn_func" in str(e.value)
    assert_no_build_has_it(dispatch.missing_bwd_kernel("sm90", BF16, d, True, set(), headdim_v=dv, varlen=True))
    # A varlen head dim that was merely left out of this build still gets its rebuild hint.
    with pytest.raises(ValueError, match=r"FLASHHOPPER_HDIMS=128 FLASHHOPPER_VARLEN=off;on"):
        choose_kernel(H100, 0, BF16, 128, "causal", None, set(), varlen=True)


def test_varlen_headdim_refused_before_any_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # flash_attn_varlen_func on (fake) CUDA tensors of a pretend H100: refused at dispatch, forward and backward.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashhopper import flash_attn_varlen_func

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kernel was looked up for launch")

    monkeypatch.setattr(_device, "device_info", lambda index: H100)
    monkeypatch.setattr(_ext, "has_kernel", lambda mode, key: False)
    monkeypatch.setattr(_ext, "kernel", no_launch)
    with FakeTensorMode():
        q, k, v = (torch.empty(8, 2, 96, dtype=BF16, device="cuda") for _ in range(3))
        cu = torch.tensor([0, 3, 8], dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError) as e:
            flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    assert_no_build_has_it(str(e.value))
    # The backward's forward-time check, should a forward kernel exist (a fake one here).
    q, k, v = (torch.randn(8, 2, 96, dtype=BF16) for _ in range(3))
    v.requires_grad_()
    with pytest.raises(ValueError, match=r"^v requires grad, but this build has no sm90 backward kernel") as e:
        dispatch.require_bwd_kernel("sm90", q, k, v, 96, True, varlen=True)
    assert_no_build_has_it(str(e.value))


def test_kvcache_and_fp8_keys_no_build_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ext, "kernel", lambda mode, key: None)
    monkeypatch.setattr(_ext, "extension_error", lambda: None)
    for key in (KernelKey(90, "bfloat16", 96, 96, "none", kvcache="on"),
                KernelKey(90, "bfloat16", 192, 128, "causal", kvcache="e4m3")):
        with pytest.raises(ValueError, match="the KV-cache kernels have head dims") as e:
            dispatch.require_kernel("fwd", key)
        assert_no_build_has_it(str(e.value))
    # An e4m3 cache on the Ampere family (backend='sm80' asked for): Hopper only, whatever the build.
    with pytest.raises(ValueError, match=r"no build has one: an e4m3 KV cache has Hopper \(sm90\) kernels only") as e:
        dispatch.require_kernel("fwd", KernelKey(80, "bfloat16", 128, 128, "none", kvcache="e4m3"))
    assert "FLASHHOPPER_" not in str(e.value)
    # fp8 keys outside the fp8 kernels' head dims and family.
    for key in (KernelKey(90, "float8_e4m3fn", 96, 96, "causal"), KernelKey(80, "float8_e4m3fn", 128, 128, "none"),
                KernelKey(90, "float8_e4m3fn", 192, 128, "none", varlen=True)):
        with pytest.raises(ValueError, match=r"the fp8 \(e4m3\) kernels are Hopper \(sm90\) ones") as e:
            dispatch.require_kernel("fwd", key)
        assert_no_build_has_it(str(e.value))
    # A buildable KV-cache key keeps its rebuild hint.
    with pytest.raises(ValueError, match=r"FLASHHOPPER_HDIMS=128 FLASHHOPPER_KVCACHE=off;on;e4m3"):
        dispatch.require_kernel("fwd", KernelKey(90, "bfloat16", 128, 128, "none", kvcache="e4m3"))


def test_kvcache_e4m3_on_sm80_no_build_has(monkeypatch: pytest.MonkeyPatch) -> None:
    # Through flash_attn_with_kvcache's backend choice: backend='sm80' with an e4m3 cache on a pretend H100.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashhopper.kvcache import CacheShapes
    from flashhopper.kvcache import resolve_backend as kvcache_backend
    monkeypatch.setattr(_ext, "kernel", lambda mode, key: None)
    monkeypatch.setattr(_device, "device_info", lambda index: H100)
    with FakeTensorMode():
        q = torch.empty(2, 1, 8, 128, dtype=BF16, device="cuda")
    shapes = CacheShapes(2, 1, 8, 2, 128, 128, True, 16, 10, 64, 0)
    with pytest.raises(ValueError, match=r"no build has one: an e4m3 KV cache has Hopper \(sm90\) kernels only"):
        kvcache_backend(q, shapes, True, "sm80", "e4m3")
