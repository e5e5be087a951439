"""Backward kernels against reference gradients on the GPU (run on the H100; skipped here).

The grid is the forward's (tests/test_fwd_gpu.py): every (seqlen_q, seqlen_k) pair of SEQLENS x head
dims x causal, with the GQA ratio, batch and dtype rotating through the cases. Each case runs the
forward kernel (fwd_into), then the backward kernel (bwd_into) with a random dout into dq, dk, dv
poisoned with NaN, and helpers.assert_grads_match judges the gradients: within twice the error of
PyTorch's own backward in the input precision (max-abs and relative norm), against reference gradients
computed in float32 on the GPU from exact out and lse. The window grid is the forward's too. Each test
runs once per kernel family; a family that cannot run on this GPU, or a configuration the build was not
configured with, is skipped with the reason; one it was configured with but lacks fails.
"""
from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_grads_match, assert_grads_match_or_control, randn_qkv, require_backend
from test_fwd_gpu import BACKENDS, NHEADS_Q, WindowCase, case_id, grid, native, window_case_id, window_grid

from flashhopper import flash_attn_func
from flashhopper.dispatch import ARCH
from flashhopper.ops import bwd_into, fwd_into
from flashhopper.validation import KERNEL_HEADDIMS

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, math.nan)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
            backend: str, window: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    b, sq, h, _ = q.shape
    out, lse = nan_like(q), torch.full((b, h, sq), math.nan, device=q.device)
    fwd_into(q, k, v, out, lse, scale, causal, ARCH[backend], window=window)
    return out, lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, scale: float, causal: bool, backend: str, deterministic: bool = False,
             dlse: torch.Tensor | None = None, window: tuple[int, int] | None = None) -> Grads:
    """bwd_into NaN-poisoned gradients, so that an element the kernel forgets to write fails."""
    dq, dk, dv = nan_like(q), nan_like(k), nan_like(v)
    bwd_into(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, deterministic, ARCH[backend], dlse=dlse,
             window=window)
    return dq, dk, dv


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", grid(), ids=case_id)
def test_bwd(case: tuple[int, int, int, bool, int, int, torch.dtype], backend: str) -> None:
    sq, sk, d, causal, gqa, batch, dtype = case
    require_backend(backend, dtype, d, causal, mode="bwd")
    q, k, v = randn_qkv(batch, sq, sk, NHEADS_Q, NHEADS_Q // gqa, d, dtype, "cuda")
    scale = 1 / math.sqrt(d)
    out, lse = forward(q, k, v, scale, causal, backend)
    dout = torch.randn_like(q)
    grads = backward(dout, q, k, v, out, lse, scale, causal, backend)
    # The grid has 1 and 17 keys, where FA3's criterion alone fails FlashAttention-style roundings now and
    # then (helpers.control_ratio).
    assert_grads_match_or_control(grads, dout, q, k, v, scale, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", window_grid(), ids=window_case_id)
def test_bwd_window(case: WindowCase, backend: str) -> None:
    sq, sk, window, causal, d, gqa, batch, dtype = case
    require_backend(backend, dtype, d, causal, mode="bwd", window=window)  # "configure FLASHHOPPER_MASKS with window"
    q, k, v = randn_qkv(batch, sq, sk, NHEADS_Q, NHEADS_Q // gqa, d, dtype, "cuda")
    scale = 1 / math.sqrt(d)
    out, lse = forward(q, k, v, scale, causal, backend, window)
    dout, dlse = torch.randn_like(q), torch.randn_like(lse)
    grads = backward(dout, q, k, v, out, lse, scale, causal, backend, dlse=dlse, window=window)
    # 17 keys as in test_bwd: a miss of FA3's bound by FlashAttention-style roundings is judged again by the control
    # (fp16 d64 GQA 8 at 300 x 17 with w (64, 64): dK max-abs 3.99e-3 against a bound of 3.81e-3, session 39).
    assert_grads_match_or_control(grads, dout, q, k, v, scale, causal, dlse, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [(0, 0), (64, 64)])
def test_bwd_window_deterministic(window: tuple[int, int], backend: str) -> None:
    # Windows leave key blocks without some query blocks (and the reverse): the dQ counters must
    # wait for exactly the key blocks that add to a query block, in a fixed order.
    require_backend(backend, torch.bfloat16, 128, False, mode="bwd", window=window)
    q, k, v = randn_qkv(2, 1500, 1300, 8, 2, 128, torch.bfloat16, "cuda")
    out, lse = forward(q, k, v, 0.1, False, backend, window)
    dout = torch.randn_like(q)
    runs = [backward(dout, q, k, v, out, lse, 0.1, False, backend, deterministic=True, window=window)
            for _ in range(3)]
    for other in runs[1:]:
        assert all(torch.equal(a, c) for a, c in zip(runs[0], other)), "gradients differ between deterministic runs"
    assert_grads_match(runs[0], dout, q, k, v, 0.1, False, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("headdim", KERNEL_HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 100, 130, 8, 2), (1, 130, 100, 4, 4), (3, 17, 1, 4, 1)])
def test_bwd_float64_reference(shape: tuple[int, int, int, int, int], causal: bool, headdim: int,
                               backend: str) -> None:
    # Small sizes against float64 gradients (the grid's reference is float32).
    require_backend(backend, torch.bfloat16, headdim, causal, mode="bwd")
    q, k, v = randn_qkv(*shape, headdim, torch.bfloat16, "cuda")
    scale = 1 / math.sqrt(headdim)
    out, lse = forward(q, k, v, scale, causal, backend)
    dout = torch.randn_like(q)
    grads = backward(dout, q, k, v, out, lse, scale, causal, backend)
    assert_grads_match(grads, dout, q, k, v, scale, causal, ref_dtype=torch.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", KERNEL_HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("sq", "sk", "hq", "hkv"), [(1000, 1000, 4, 4), (255, 700, 4, 1), (700, 130, 4, 2)])
def test_bwd_sm80_small_smem_tiles(sq: int, sk: int, hq: int, hkv: int, causal: bool, headdim: int) -> None:
    # The sm80 backward picks its tiles by the shared memory a block may use; sm_86/sm_89 allow
    # 99 KB, a third of the H100's. max_smem_bytes runs those tiles here.
    require_backend("sm80", torch.bfloat16, headdim, causal, mode="bwd")
    q, k, v = randn_qkv(2, sq, sk, hq, hkv, headdim, torch.bfloat16, "cuda")
    scale = 1 / math.sqrt(headdim)
    out, lse = forward(q, k, v, scale, causal, "sm80")
    dout = torch.randn_like(q)
    dq, dk, dv = nan_like(q), nan_like(k), nan_like(v)
    bwd_into(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, False, 80, max_smem_bytes=99 * 1024)
    assert_grads_match((dq, dk, dv), dout, q, k, v, scale, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("shape", "causal", "dtype"), [
    ((2, 2000, 2000, 8, 8, 128), False, torch.bfloat16),
    ((2, 2000, 2000, 8, 2, 128), True, torch.bfloat16),   # GQA: dk/dv summed over a group of 4 heads
    ((1, 700, 3000, 8, 1, 64), True, torch.float16),      # MQA, seqlen_q < seqlen_k
    ((1, 3000, 700, 8, 4, 256), False, torch.bfloat16),
])
def test_deterministic(shape: tuple[int, ...], causal: bool, dtype: torch.dtype, backend: str) -> None:
    # deterministic=True: bitwise-identical gradients over repeated runs (the fp32 accumulations
    # across CTAs happen in a fixed order), and still the right ones.
    b, sq, sk, hq, hkv, d = shape
    require_backend(backend, dtype, d, causal, mode="bwd")
    q, k, v = randn_qkv(b, sq, sk, hq, hkv, d, dtype, "cuda")
    scale = 1 / math.sqrt(d)
    out, lse = forward(q, k, v, scale, causal, backend)
    dout = torch.randn_like(q)
    runs = [backward(dout, q, k, v, out, lse, scale, causal, backend, deterministic=True) for _ in range(3)]
    for other in runs[1:]:
        for name, a, c in zip(("dq", "dk", "dv"), runs[0], other):
            assert torch.equal(a, c), f"{name} differs between deterministic runs"
    assert_grads_match(runs[0], dout, q, k, v, scale, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 300, 700, 8, 2, 128), (1, 700, 300, 8, 8, 64), (2, 255, 1, 4, 1, 256)])
def test_dlse(shape: tuple[int, ...], causal: bool, backend: str) -> None:
    # A loss that uses lse too: dlse folds into D. Rows that see no key get a dlse as well; it must
    # not matter. (seqlen_k 1: dq, dk are no longer zero with a dlse.)
    b, sq, sk, hq, hkv, d = shape
    require_backend(backend, torch.bfloat16, d, causal, mode="bwd")
    q, k, v = randn_qkv(b, sq, sk, hq, hkv, d, torch.bfloat16, "cuda")
    scale = 1 / math.sqrt(d)
    out, lse = forward(q, k, v, scale, causal, backend)
    dout, dlse = torch.randn_like(q), torch.randn_like(lse)
    grads = backward(dout, q, k, v, out, lse, scale, causal, backend, dlse=dlse)
    assert_grads_match(grads, dout, q, k, v, scale, causal, dlse=dlse)


def autograd_case() -> tuple[torch.Tensor, ...]:
    """q, k, v leaves (bf16, GQA, seqlen_q != seqlen_k) and upstream gradients for out and lse."""
    q, k, v = (x.requires_grad_() for x in randn_qkv(2, 1000, 1200, 8, 2, 128, torch.bfloat16, "cuda"))
    return q, k, v, torch.randn(q.shape, dtype=torch.bfloat16, device="cuda"), torch.randn(2, 8, 1000, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_autograd(causal: bool) -> None:
    backend = native()
    require_backend(backend, torch.bfloat16, 128, causal, mode="bwd")
    q, k, v, dout, dlse = autograd_case()
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    torch.autograd.backward([out, lse], [dout, dlse])
    grads = tuple(x.grad for x in (q, k, v))
    assert all(g is not None and g.dtype == torch.bfloat16 and g.shape == x.shape for g, x in zip(grads, (q, k, v)))
    assert_grads_match(grads, dout, *(x.detach() for x in (q, k, v)), None, causal, dlse=dlse)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_autograd_out_sum() -> None:
    # out.sum(): a stride-0 upstream gradient, made dense before the kernel; lse unused: no dlse.
    require_backend(native(), torch.bfloat16, 128, True, mode="bwd")
    q, k, v, _, _ = autograd_case()
    flash_attn_func(q, k, v, causal=True).sum().backward()
    assert_grads_match(tuple(x.grad for x in (q, k, v)), torch.ones_like(q),  # type: ignore[arg-type]
                       *(x.detach() for x in (q, k, v)), None, True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_compile_forward_backward(causal: bool) -> None:
    require_backend(native(), torch.bfloat16, 128, causal, mode="bwd")
    q, k, v, dout, dlse = autograd_case()

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, deterministic=True)
        return (out.float() * dout).sum() + (lse * dlse).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)  # the same deterministic kernels on the same inputs
    assert_grads_match(got, dout, *(x.detach() for x in (q, k, v)), None, causal, dlse=dlse)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("headdim", KERNEL_HEADDIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_strided_inputs_and_grads(headdim: int, causal: bool, backend: str) -> None:
    # q, k, v sliced from one packed (batch, seqlen, 3, nheads, headdim) tensor; out, dout and dq,
    # dk, dv views with padded heads: valid TMA strides, none of them the contiguous ones.
    require_backend(backend, torch.bfloat16, headdim, causal, mode="bwd")
    qkv = torch.randn(2, 1000, 3, 8, headdim, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv.unbind(2)
    scale = 1 / math.sqrt(headdim)

    def padded() -> torch.Tensor:
        return torch.full((2, 1000, 8, 2 * headdim), math.nan, dtype=torch.bfloat16, device="cuda")[..., :headdim]

    out, lse = padded(), torch.full((2, 8, 1000), math.nan, device="cuda")
    fwd_into(q, k, v, out, lse, scale, causal, ARCH[backend])
    dout = padded().normal_()
    dq, dk, dv = padded(), padded(), padded()
    bwd_into(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, False, ARCH[backend])
    assert_grads_match((dq, dk, dv), dout, q, k, v, scale, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_packed_heads(backend: str) -> None:
    # Fused GQA projection: (batch, seqlen, nheads_q + 2 * nheads_kv, headdim), split along heads;
    # autograd assembles the three gradients into one for the packed tensor.
    require_backend(backend, torch.float16, 128, True, mode="bwd")
    x = torch.randn(3, 777, 8 + 2 * 2, 128, dtype=torch.float16, device="cuda", requires_grad=True)
    q, k, v = x[:, :, :8], x[:, :, 8:10], x[:, :, 10:]
    out = flash_attn_func(q, k, v, causal=True, backend=backend)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert x.grad is not None
    grads = (x.grad[:, :, :8], x.grad[:, :, 8:10], x.grad[:, :, 10:])
    assert_grads_match(grads, dout, *(t.detach() for t in (q, k, v)), None, True)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_no_keys(causal: bool, deterministic: bool, backend: str) -> None:
    # seqlen_k 0: no key block, so the main kernel launches no CTA, but the dQ postprocess still runs
    # and writes dq = 0 (every sum is empty) over the NaN poison.
    require_backend(backend, torch.bfloat16, 128, causal, mode="bwd")
    q, k, v = randn_qkv(2, 300, 0, 8, 2, 128, torch.bfloat16, "cuda")
    out, lse = forward(q, k, v, 0.1, causal, backend)
    dq, dk, dv = nan_like(q), nan_like(k), nan_like(v)
    ctas = bwd_into(torch.randn_like(q), q, k, v, out, lse, dq, dk, dv, 0.1, causal, deterministic, ARCH[backend])
    assert ctas == 0 and (dq == 0).all() and dk.numel() == dv.numel() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_no_queries(causal: bool, deterministic: bool, backend: str) -> None:
    # seqlen_q 0: every key block's query range is empty; the kernel runs (CTAs launched) and writes
    # dk = dv = 0 over the NaN poison (GQA: through the fp32 accumulators and their conversion).
    require_backend(backend, torch.bfloat16, 128, causal, mode="bwd")
    q, k, v = randn_qkv(2, 0, 300, 8, 2, 128, torch.bfloat16, "cuda")
    out, lse = forward(q, k, v, 0.1, causal, backend)
    dq, dk, dv = nan_like(q), nan_like(k), nan_like(v)
    ctas = bwd_into(torch.randn_like(q), q, k, v, out, lse, dq, dk, dv, 0.1, causal, deterministic, ARCH[backend])
    assert ctas > 0 and (dk == 0).all() and (dv == 0).all() and dq.numel() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", [64, 128])
def test_workspace_not_assumed_zero(headdim: int, causal: bool, deterministic: bool, backend: str) -> None:
    # The backward's workspace comes from torch.empty: the Hopper kernel does not zero dQ's float32 sums (the
    # first key block to reach a query block stores), so memory the caching allocator hands back full of NaN
    # must not reach a gradient. 300 queries over 100 keys, causal: the top 200 rows see no key (their dq is 0
    # without any key block writing their sums); several key blocks per query block elsewhere.
    require_backend(backend, torch.bfloat16, headdim, causal, mode="bwd")
    q, k, v = randn_qkv(2, 300, 1000 if not causal else 100, 8, 2, headdim, torch.bfloat16, "cuda")
    scale = 1 / math.sqrt(headdim)
    out, lse = forward(q, k, v, scale, causal, backend)
    dout = torch.randn_like(q)
    for _ in range(2):
        junk = torch.full((64 << 20,), math.nan, device="cuda")  # 256 MB of NaN, back in the allocator's cache
        del junk
        grads = backward(dout, q, k, v, out, lse, scale, causal, backend, deterministic)
        assert_grads_match(grads, dout, q, k, v, scale, causal)
    if causal:
        assert (grads[0][:, :200] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_no_keys_and_no_queries_through_autograd(causal: bool) -> None:
    require_backend(native(), torch.bfloat16, 128, causal, mode="bwd")
    for sq, sk in ((64, 0), (0, 64), (0, 0)):
        leaves = [x.requires_grad_() for x in randn_qkv(2, sq, sk, 8, 2, 128, torch.bfloat16, "cuda")]
        flash_attn_func(*leaves, causal=causal).sum().backward()
        assert all(x.grad is not None and (x.grad == 0).all() for x in leaves)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 128, 64, 8, 8), (2, 128, 64, 0, 0)])
def test_empty_grid(shape: tuple[int, int, int, int, int], backend: str) -> None:
    # Batch or nheads 0: every gradient has no element, and the launcher launches nothing (an empty
    # grid; its return says so).
    require_backend(backend, torch.bfloat16, 128, False, mode="bwd")
    q, k, v = randn_qkv(*shape, 128, torch.bfloat16, "cuda")
    out, lse = forward(q, k, v, 0.1, False, backend)
    dq, dk, dv = nan_like(q), nan_like(k), nan_like(v)
    assert bwd_into(torch.randn_like(q), q, k, v, out, lse, dq, dk, dv, 0.1, False, False, ARCH[backend]) == 0
    leaves = [x.requires_grad_() for x in (q, k, v)]
    flash_attn_func(*leaves, backend=backend).sum().backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in leaves)


@pytest.mark.gpu
def test_misaligned_dout_is_refused_before_launch() -> None:
    backend = native()
    require_backend(backend, torch.bfloat16, 128, False, mode="bwd")
    q, k, v = randn_qkv(2, 128, 128, 8, 8, 128, torch.bfloat16, "cuda")
    out, lse = forward(q, k, v, 0.1, False, backend)
    base = torch.randn(q.numel() + 1, dtype=torch.bfloat16, device="cuda")
    dout = base[1:].view(q.shape)  # 2 bytes off a 16-byte boundary
    with pytest.raises(ValueError, match=r"^dout data pointer"):
        backward(dout, q, k, v, out, lse, 0.1, False, backend)


@pytest.mark.gpu
def test_concurrent_streams() -> None:
    # Each launch gets its own workspace on its own stream: two streams at once must not mix.
    backend = native()
    require_backend(backend, torch.bfloat16, 128, True, mode="bwd")
    cases = []
    for _ in range(2):
        q, k, v = randn_qkv(2, 2048, 2048, 8, 2, 128, torch.bfloat16, "cuda")
        out, lse = forward(q, k, v, 0.1, True, backend)
        cases.append((torch.randn_like(q), q, k, v, out, lse))
    first = [backward(*c, 0.1, True, backend, deterministic=True) for c in cases]
    streams = [torch.cuda.Stream() for _ in range(2)]
    torch.cuda.synchronize()
    results = []
    for _ in range(3):
        for s, c in zip(streams, cases):
            with torch.cuda.stream(s):
                results.append(backward(*c, 0.1, True, backend, deterministic=True))
    torch.cuda.synchronize()
    for i, grads in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(grads, first[i % 2]))
    assert_grads_match(first[0], cases[0][0], *cases[0][1:4], 0.1, True)
