"""CUDA autocast, as for SDPA: under torch.autocast("cuda"), float32/float16/bfloat16 CUDA inputs run in the
autocast dtype, through the public functions (cast before dispatch) and the ops' AutocastCUDA kernels
(cast the activations only, run the op below autocast); CPU tensors, float64 and fp8 are never cast.

Without a GPU (here): FakeTensorMode makes fake CUDA tensors on a CPU-only torch, with CUDA's dispatch keys
(AutocastCUDA among them), and torch.set_autocast_enabled switches CUDA autocast on (torch.autocast("cuda")
turns itself off without a GPU). A dispatch mode, which sits below the Autocast key, records what each op
receives; the device and the kernel table are those of a pretend H100 (the fake ops launch nothing).
Fake CUDA tensors cannot require grad on a CPU-only torch (autograd asks for a CUDA device guard), so
gradients are checked on the GPU. On the GPU (marked gpu): results bit for bit those of the inputs cast by
hand, against SDPA under the same autocast with FA3's criterion, gradients, ops, torch.compile, fp8.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_grads_match, assert_matches_reference, max_abs_err, randn_qkv, rel_err, require_backend
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from flashhopper import _autocast, _device, _ext, flash_attn_fp8_func, flash_attn_func, fp8, quantize_fp8, quantize_kv
from flashhopper._ext import Entry
from flashhopper.reference import attention_ref

LOW = [torch.bfloat16, torch.float16]
FP8 = torch.float8_e4m3fn


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """CUDA autocast on, in ``dtype``, whether or not this machine has a GPU; the previous state restored."""
    was, was_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", was)
        torch.set_autocast_dtype("cuda", was_dtype)


class Recorder(TorchDispatchMode):
    """Records each flashhopper op as it reaches the layers below autocast: (name, args), a tensor
    given as its dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace == "flashhopper":
            self.calls.append((func.__name__.removesuffix(".default"),
                               tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args)))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def h100(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pretend H100 whose build has every dense kernel at head dim 128, the fp8 forward (tiles 128 x 128)
    and the quantization kernel."""
    monkeypatch.setattr(_device, "device_info", lambda index: _device.DeviceInfo("H100", (9, 0), 132))
    monkeypatch.setattr(_ext, "kernel", lambda mode, key: Entry(0, 128, 128) if key.headdim == 128 else None)
    monkeypatch.setattr(_ext, "has_fp8_quantize", lambda: True)


def fake_cuda(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cuda")


def fake_qkv(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (2, 33, 8, 128), k and v (2, 17, 2, 128), on CUDA (made under a FakeTensorMode)."""
    return (fake_cuda(2, 33, 8, 128, dtype=dtype), fake_cuda(2, 17, 2, 128, dtype=dtype),
            fake_cuda(2, 17, 2, 128, dtype=dtype))


# --- the ops' AutocastCUDA kernels ---

def test_every_op_has_an_autocast_kernel() -> None:
    ops = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("flashhopper::")]
    assert {"flashhopper::fwd", "flashhopper::bwd", "flashhopper::fwd_fp8", "flashhopper::quantize_fp8"} <= set(ops)
    for name in ops:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA"), name


@pytest.mark.parametrize("dtype", LOW)
def test_ops_cast_their_activations_only(dtype: torch.dtype) -> None:
    with FakeTensorMode():
        q, k, v = fake_qkv()
        lse = fake_cuda(2, 8, 33)
        q8, k8, _ = fake_qkv(FP8)
        vt = fake_cuda(2, 2, 128, 32, dtype=FP8)
        qs, ks, vs = fake_cuda(2, 8, 1), fake_cuda(2, 2, 1), fake_cuda(2, 2, 1)
        with cuda_autocast(dtype), Recorder() as rec:
            out, out_lse = torch.ops.flashhopper.fwd.default(q, k, v, 0.1, True, -1, -1, 0.0, None, False, "sm90")
            grads = torch.ops.flashhopper.bwd.default(q, q, k, v, q, lse, lse, 0.1, True, -1, -1, 0.0, None, False, "sm90")
            out8, lse8 = torch.ops.flashhopper.fwd_fp8.default(q8, qs, k8, ks, vt, vs, None, None, None, 0.1, False)
            data, scale = torch.ops.flashhopper.quantize_fp8.default(q, 64, 5, False)
            q64 = torch.ops.flashhopper.fwd.default(q.double(), k.double(), v.double(), 0.1, False, -1, -1, 0.0, None, False,
                                                    "reference")[0]
    f32 = torch.float32
    assert rec.calls == [
        ("fwd", (dtype, dtype, dtype, 0.1, True, -1, -1, 0.0, None, False, "sm90")),      # activations cast
        ("bwd", (f32, f32, f32, f32, f32, f32, f32, 0.1, True, -1, -1, 0.0, None, False, "sm90")),  # nothing cast
        ("fwd_fp8", (FP8, f32, FP8, f32, FP8, f32, None, None, None, 0.1, False)),       # fp8 data, float32 scales
        ("quantize_fp8", (dtype, 64, 5, False)),
        ("fwd", (torch.float64,) * 3 + (0.1, False, -1, -1, 0.0, None, False, "reference")),  # autocast leaves float64
    ]
    assert (out.dtype, out_lse.dtype) == (dtype, f32) and all(g.dtype == f32 for g in grads)
    assert (out8.dtype, lse8.dtype, data.dtype, scale.dtype) == (torch.bfloat16, f32, FP8, f32)
    assert q64.dtype == torch.float64


def test_ops_without_autocast_cast_nothing() -> None:
    # The Autocast key is not dispatched to while autocast is off: float32 reaches the op as it is.
    with FakeTensorMode():
        q = fake_cuda(1, 8, 2, 64)
        with Recorder() as rec:
            out, _ = torch.ops.flashhopper.fwd.default(q, q, q, 0.1, False, -1, -1, 0.0, None, False, "reference")
            torch.ops.flashhopper.quantize_fp8.default(q, 64, None, False)
    assert [dtypes[:1] for _, dtypes in rec.calls] == [(torch.float32,)] * 2 and out.dtype == torch.float32


def test_cast() -> None:
    with FakeTensorMode():
        x32, x16, x64, x8 = (fake_cuda(2, 3, dtype=d) for d in (torch.float32, torch.float16, torch.float64, FP8))
        ints = fake_cuda(2, 3, dtype=torch.int32)
    cpu = torch.randn(2, 3)
    t8 = fp8.FP8Tensor(x8, x32, None, None, False, 2)
    with cuda_autocast(torch.bfloat16):
        got = _autocast.cast(x32, x16, x64, x8, ints, cpu, t8, "q", None)
    assert [g.dtype for g in got[:5]] == [torch.bfloat16, torch.bfloat16, torch.float64, FP8, torch.int32]
    assert got[5] is cpu and got[6] is t8 and got[7:] == ("q", None)


# --- the public functions: cast before validation and dispatch ---

@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("given", [torch.float32, torch.float16, torch.bfloat16])
def test_flash_attn_func_casts_before_dispatch(h100: None, dtype: torch.dtype, given: torch.dtype) -> None:
    with FakeTensorMode():
        q, k, v = fake_qkv(given)
        with cuda_autocast(dtype), Recorder() as rec:
            out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert rec.calls == [("fwd", (dtype, dtype, dtype, 1 / math.sqrt(128), True, -1, -1, 0.0, None, False, "sm90"))]
    assert (out.dtype, lse.dtype) == (dtype, torch.float32)


def test_flash_attn_func_without_autocast_is_unchanged(h100: None) -> None:
    with FakeTensorMode():
        q = fake_cuda(1, 8, 2, 128)
        with pytest.raises(TypeError, match=r"^q has dtype torch.float32; the flashhopper kernels"):
            flash_attn_func(q, q, q)
        with cuda_autocast(torch.bfloat16), pytest.raises(TypeError, match=r"^q has dtype torch.float64"):
            flash_attn_func(q.double(), q.double(), q.double())  # autocast leaves float64: as without it


def test_cpu_tensors_are_not_cast() -> None:
    # CUDA autocast does not apply to CPU tensors (nor does it to SDPA's): the reference runs in float32.
    q, k, v = randn_qkv(2, 20, 30, 4, 2, 64)
    want, want_lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    with cuda_autocast(torch.bfloat16):
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        with pytest.raises(TypeError, match=r"^x has dtype torch.float32"):
            quantize_fp8(q)
        with pytest.raises(TypeError, match=r"^q has dtype torch.float32"):
            flash_attn_fp8_func(q, k, v)
    assert out.dtype == torch.float32 and torch.equal(out, want) and torch.equal(lse, want_lse)


def test_mixed_devices_name_the_device() -> None:
    # Under autocast only the CUDA tensor is cast; the error is about the device, not the dtypes that follow.
    k = torch.randn(1, 8, 2, 64)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = fake_cuda(1, 8, 2, 64)
        with cuda_autocast(torch.bfloat16), pytest.raises(ValueError, match=r"^k is on cpu but q is on cuda"):
            flash_attn_func(q, k, k)


@pytest.mark.parametrize("dtype", LOW)
def test_fp8_entry_points_cast_before_quantizing(h100: None, dtype: torch.dtype) -> None:
    with FakeTensorMode():
        q, k, v = fake_cuda(2, 64, 8, 128), fake_cuda(2, 256, 2, 128), fake_cuda(2, 256, 2, 128)
        with cuda_autocast(dtype), Recorder() as rec:
            out = flash_attn_fp8_func(q, k, v, causal=True)
            x8 = quantize_fp8(q)
            kv = quantize_kv(k, v)
            out_kv = kv.attend(q)
    quantized = [dtypes[0] for name, dtypes in rec.calls if name == "quantize_fp8"]
    attended = [dtypes[:6] for name, dtypes in rec.calls if name == "fwd_fp8"]
    assert quantized == [dtype] * (3 + 1 + 2 + 1)  # flash_attn_fp8_func q, k, v; quantize_fp8; quantize_kv; attend
    assert attended == [(FP8, torch.float32) * 3] * 2
    assert out.dtype == out_kv.dtype == torch.bfloat16  # the fp8 kernel's output, whatever the inputs
    assert x8.data.dtype == kv.k.data.dtype == FP8


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile is not supported here")
def test_compile_follows_the_autocast_state(h100: None) -> None:
    # Dynamo guards on the autocast state: one compiled function gives each autocast dtype its own graph,
    # each with the cast in front of the op (fullgraph: no break on the way).
    torch._dynamo.reset()

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
        return out * 2, flash_attn_fp8_func(q, k, v)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = fake_cuda(1, 64, 4, 128), fake_cuda(1, 128, 2, 128), fake_cuda(1, 128, 2, 128)
        for dtype in LOW:
            with cuda_autocast(dtype):
                out, out8 = compiled(q, k, v)
            assert (out.dtype, out8.dtype) == (dtype, torch.bfloat16)


# --- on the GPU ---

def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA in flash-attn's layout, GQA by repeating the kv heads (non-causal)."""
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2).transpose(1, 2) for x in (k, v))
    return F.scaled_dot_product_attention(q.transpose(1, 2), k, v).transpose(1, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW)
def test_forward_under_autocast(dtype: torch.dtype) -> None:
    require_backend("sm90", dtype, 128, False)
    q, k, v = randn_qkv(2, 300, 257, 8, 2, 128, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        out, lse = flash_attn_func(q, k, v, return_lse=True)
        ref_sdpa = sdpa(q, k, v)
    want, want_lse = flash_attn_func(q.to(dtype), k.to(dtype), v.to(dtype), return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert out.dtype == ref_sdpa.dtype == dtype and lse.dtype == torch.float32
    ql, kl, vl = q.to(dtype), k.to(dtype), v.to(dtype)  # what both took, autocast's cast
    assert_matches_reference(out, lse, ql, kl, vl, None, causal=False)
    exact = attention_ref(ql, kl, vl)[0]  # float64; FA3's criterion against SDPA itself
    assert max_abs_err(out, exact) <= 2 * max_abs_err(ref_sdpa, exact) + 1e-4
    assert rel_err(out, exact) <= 2 * rel_err(ref_sdpa, exact) + 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("backward_inside", [False, True])
@pytest.mark.parametrize("backend", ["sm90", "reference"])
@pytest.mark.parametrize("dtype", LOW)
def test_gradients_under_autocast(dtype: torch.dtype, backend: str, backward_inside: bool) -> None:
    # float32 leaves get float32 gradients: those of the cast inputs (autocast's cast is differentiable),
    # the same whether backward() runs inside the autocast region or after it (bwd runs below autocast, so
    # the reference keeps its float32 matmuls there too).
    if backend == "sm90":
        require_backend("sm90", dtype, 128, True, mode="bwd")
    q, k, v = (x.requires_grad_() for x in randn_qkv(2, 200, 300, 8, 2, 128, device="cuda"))
    dout = torch.randn(2, 200, 8, 128, dtype=dtype, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        out = flash_attn_func(q, k, v, causal=True, backend=backend, deterministic=True)
        if backward_inside:
            out.backward(dout)
    if not backward_inside:
        out.backward(dout)
    low = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    flash_attn_func(*low, causal=True, backend=backend, deterministic=True).backward(dout)
    for x, lx in zip((q, k, v), low):
        assert x.grad is not None and lx.grad is not None and x.grad.dtype == torch.float32
        assert torch.equal(x.grad, lx.grad.float())
    ql, kl, vl = (lx.detach() for lx in low)
    assert_grads_match((low[0].grad, low[1].grad, low[2].grad), dout, ql, kl, vl, None, True)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sm90", "reference"])
def test_op_called_directly(backend: str) -> None:
    # The op casts q, k, v itself and runs its body below autocast: the reference keeps its float32 matmuls.
    if backend == "sm90":
        require_backend("sm90", torch.bfloat16, 128, False)
    q, k, v = randn_qkv(1, 100, 130, 4, 2, 128, device="cuda")
    args = (0.1, False, -1, -1, 0.0, None, False, backend)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, lse = torch.ops.flashhopper.fwd.default(q, k, v, *args)
    want, want_lse = torch.ops.flashhopper.fwd.default(q.bfloat16(), k.bfloat16(), v.bfloat16(), *args)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_under_autocast(backend: str) -> None:
    require_backend("sm90", torch.bfloat16, 128, True, mode="bwd")
    torch._dynamo.reset()

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return flash_attn_func(q, k, v, causal=True, deterministic=True)

    def grads(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):  # type: ignore[no-untyped-def]
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out.float().square().sum(), leaves))

    q, k, v = randn_qkv(2, 128, 192, 8, 2, 128, device="cuda")
    got = grads(torch.compile(step, fullgraph=True, backend=backend), q, k, v)
    want = grads(step, q, k, v)
    assert got[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in got[1:])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW)
def test_fp8_under_autocast(dtype: torch.dtype) -> None:
    from test_fp8_gpu import require_fp8_kernel, require_quant_kernel

    require_fp8_kernel(128, False)
    require_quant_kernel()
    q, k, v = randn_qkv(2, 128, 256, 8, 2, 128, device="cuda")
    low = [x.to(dtype) for x in (q, k, v)]
    with torch.autocast("cuda", dtype=dtype):
        out, lse = flash_attn_fp8_func(q, k, v, return_lse=True)
        x8 = quantize_fp8(k)
        kv = quantize_kv(k, v)
        out_kv = kv.attend(q)
        op_data, op_scale = torch.ops.flashhopper.quantize_fp8.default(k, 128, 7, False)
    want, want_lse = flash_attn_fp8_func(*low, return_lse=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want) and torch.equal(lse, want_lse)
    want8 = quantize_fp8(low[1])
    assert torch.equal(x8.data.view(torch.uint8), want8.data.view(torch.uint8)) and torch.equal(x8.scale, want8.scale)
    want_kv = quantize_kv(low[1], low[2])
    for got_t, want_t in ((kv.k, want_kv.k), (kv.v, want_kv.v)):
        assert torch.equal(got_t.data.view(torch.uint8), want_t.data.view(torch.uint8))
        assert torch.equal(got_t.scale, want_t.scale)
    assert torch.equal(out_kv, want_kv.attend(low[0]))
    data, scale = torch.ops.flashhopper.quantize_fp8.default(low[1], 128, 7, False)
    assert torch.equal(op_data.view(torch.uint8), data.view(torch.uint8)) and torch.equal(op_scale, scale)
    # fwd_fp8 casts nothing: its float32 scales reach the kernel as they are.
    q8 = quantize_fp8(low[0], 64)
    args = (q8.data, q8.scale, kv.k.data, kv.k.scale, kv.v.data, kv.v.scale, 64, kv.k.block_size, kv.v.block_size,
            0.1, False)
    with torch.autocast("cuda", dtype=dtype):
        got = torch.ops.flashhopper.fwd_fp8.default(*args)
    assert all(torch.equal(g, w) for g, w in zip(got, torch.ops.flashhopper.fwd_fp8.default(*args)))

