"""Packed-batch fp8 on the GPU (skipped here): the quantization kernel over a packed batch and the Hopper
packed-batch fp8 forward (fp8/packed.py, fp8/varlen.py).

Each sequence of a packed batch is quantized and attended exactly as a padded batch of one, so the kernels
are held to the padded fp8 path bit for bit: the quantization kernel's bytes and scales against
``quantize_fp8`` of each sequence alone (and the reference's packed layout), the attention's out and lse against
``flash_attn_fp8_func`` of each sequence alone (the same tiles, scales and order of operations), which
test_fp8_gpu holds to the references. Outputs are poisoned with NaN first: rows of no sequence must keep the
poison, every other row must be written. A leak test rewrites one sequence's fp8 bytes and requires every
other sequence's output to stay bitwise the same. Then seqused against the packed reference emulation,
torch.compile and a CUDA-graph capture. A test FAILS when the build was configured with the kernel it needs
and lacks it.
"""
from __future__ import annotations

import math

import pytest
import torch
from helpers import fp8_kernel_block_n, rel_err, unconfigured

import flashhopper
from flashhopper import _device, _ext, fp8, reference, reference_fp8
from flashhopper.fp8 import PackedFP8Tensor

pytestmark = pytest.mark.gpu

DEV = "cuda"
SEED = 5
# (q lengths, k lengths or None): empty and one-token sequences, lengths straddling the 128-row tiles and
# the scale blocks, a long sequence among short ones, more keys than queries and fewer.
LENGTHS = [
    ([1], None),
    ([0, 5, 0], None),
    ([17, 128, 129, 255, 1], None),
    ([1000, 3, 300, 64], None),
    ([2000, 1, 2, 7, 65, 500], None),
    ([100, 200, 5], [300, 17, 5]),
    ([40, 1, 700], [0, 9, 1500]),
]


def require_kernel(headdim: int, causal: bool) -> int:
    info = _device.device_info(torch.cuda.current_device())
    if info.capability != (9, 0):
        pytest.skip(f"the fp8 kernels are sm_90a code; this GPU is {info.name}")
    tiles = fp8.varlen_kernel_tiles(headdim, causal)
    if tiles is None:
        key = fp8.varlen_kernel_key(headdim, causal)
        if _ext.configured("fwd", key):
            pytest.fail(f"the build was configured with {key.describe()} but does not have it: {_ext.build_info()}")
        pytest.skip(f"no {key.describe()}: " + (unconfigured("fwd", key) or "not compiled"))
    if not _ext.has_fp8_quantize():
        pytest.fail("the build has the fp8 kernels but no quantization kernel")
    return tiles[1]


def cu(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEV)


def tokens(n: int, h: int, d: int, spread: bool = False, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    mag = 2.0 ** torch.randint(-4, 5, (n, h, 1), device=DEV) if spread else 1.0
    return (torch.randn(n, h, d, device=DEV) * mag).to(dtype)


def poison(*nbytes: int) -> None:
    """Hand 0xFF-filled memory (NaN as e4m3 and float32) to the next allocations of these sizes (best effort)."""
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device=DEV) for n in nbytes if n > 0]
    del blocks


@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("transpose,hadamard", [(False, True), (True, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_packed(headdim: int, transpose: bool, hadamard: bool, dtype: torch.dtype) -> None:
    require_kernel(headdim, False)
    torch.manual_seed(0)
    lens = [1000, 0, 3, 130, 64, 1]
    block = 64 if headdim == 256 else 128
    c = cu(lens)
    x = tokens(sum(lens) + 5, 3, headdim, spread=True, dtype=dtype)  # 5 rows past the last sequence
    n = x.shape[0] // block + len(lens)
    poison(3 * n * 4, x.numel() if not transpose else 3 * headdim * n * block)
    got = flashhopper.quantize_fp8(x, block, hadamard, SEED, transpose=transpose, cu_seqlens=c, kernel=True)
    want = reference_fp8.quantize_varlen_ref(x, c, block, SEED if hadamard else None, transpose)
    assert got.scale.shape == want.scale.shape == (3, n)
    assert torch.isfinite(got.scale).all(), "scales left unwritten"
    rows = fp8.from_vt_packed(got) if transpose else got
    inside = fp8.token_layout(c, x.shape[0], block)[2]
    for b, (s0, s1) in enumerate(zip(c.tolist(), c.tolist()[1:])):
        if s1 == s0:
            continue
        alone = flashhopper.quantize_fp8(x[None, s0:s1], block, hadamard, SEED, kernel=True)
        first = s0 // block + b
        assert torch.equal(got.scale[:, first:first + alone.nblocks], alone.scale[0]), f"scales of sequence {b}"
        assert torch.equal(rows.data[s0:s1].view(torch.uint8), alone.data[0].view(torch.uint8)), f"bytes of {b}"
    if not hadamard:  # no arithmetic to reorder: the reference's bytes and scales exactly
        assert torch.equal(got.scale, want.scale)
        if transpose:
            assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), "V^T incl. its zero gaps"
        else:
            assert torch.equal(got.data.view(torch.uint8)[inside], want.data.view(torch.uint8)[inside])


def run_poisoned(q8: PackedFP8Tensor, k8: PackedFP8Tensor, v8: PackedFP8Tensor, causal: bool, used_q=None,
                 used_k=None) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full((q8.total, q8.nheads, q8.headdim), math.nan, dtype=torch.bfloat16, device=DEV)
    lse = torch.full((q8.nheads, q8.total), math.nan, dtype=torch.float32, device=DEV)
    lq = (q8.cu_seqlens[1:] - q8.cu_seqlens[:-1]) if used_q is None else used_q
    lk = (k8.cu_seqlens[1:] - k8.cu_seqlens[:-1]) if used_k is None else used_k
    fp8.launch_varlen_fwd(q8, k8, v8, used_q, used_k, int(lq.max()), int(lk.max()), out, lse,
                          q8.headdim ** -0.5, causal)
    return out, lse


def quantize_packed(q, k, v, cq, ck, block_n):
    return (flashhopper.quantize_fp8(q, 64, True, SEED, cu_seqlens=cq),
            flashhopper.quantize_fp8(k, block_n, True, SEED, cu_seqlens=ck),
            flashhopper.quantize_fp8(v, block_n, False, transpose=True, cu_seqlens=ck))


@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", range(len(LENGTHS)))
def test_each_sequence_as_a_batch_of_one(headdim: int, causal: bool, case: int) -> None:
    block_n = require_kernel(headdim, causal)
    assert fp8.kernel_tiles(headdim, causal) is not None, "the padded fp8 kernel this test compares with"
    torch.manual_seed(case)
    lq, lk = LENGTHS[case]
    lk = lq if lk is None else lk
    hq, hkv = 4, 2
    q, k, v = tokens(sum(lq) + 3, hq, headdim), tokens(sum(lk) + 3, hkv, headdim), tokens(sum(lk) + 3, hkv, headdim)
    cq, ck = cu(lq), cu(lk)
    q8, k8, v8 = quantize_packed(q, k, v, cq, ck, block_n)
    out, lse = run_poisoned(q8, k8, v8, causal)
    used = torch.zeros(q.shape[0], dtype=torch.bool, device=DEV)
    for b in range(len(lq)):
        q0, k0 = int(cq[b]), int(ck[b])
        if lq[b] == 0:
            continue
        used[q0:q0 + lq[b]] = True
        o, l = flashhopper.flash_attn_fp8_func(q[None, q0:q0 + lq[b]], k[None, k0:k0 + lk[b]], v[None, k0:k0 + lk[b]],
                                               causal=causal, return_lse=True, seed=SEED, kv_block_size=block_n)
        where = f"sequence {b} ({lq[b]} x {lk[b]}) of {lq} x {lk}, d {headdim}, causal={causal}"
        padded_n = fp8_kernel_block_n(headdim, causal, lk[b], block_n, block_n)
        if padded_n != block_n and lk[b] > padded_n:
            # The padded call runs the short-key tile (one block_n block covers the row): other tiles, another
            # rounding order; the same attention within fp8's error, lse within float32's.
            e = rel_err(out[q0:q0 + lq[b]], o[0])
            assert e < 8e-2, f"out differs from the padded short-key kernel's by {e:.3e}: {where}"
            assert torch.allclose(lse[:, q0:q0 + lq[b]], l[0], atol=1e-3, rtol=0), where
            continue
        if not torch.equal(out[q0:q0 + lq[b]], o[0]):
            d = (out[q0:q0 + lq[b]].float() - o[0].float()).abs().max().item()
            pytest.fail(f"out differs from the padded kernel's (max {d:.3e}): {where}")
        assert torch.equal(lse[:, q0:q0 + lq[b]], l[0]), where
    assert torch.isnan(out[~used]).all() and torch.isnan(lse[:, ~used]).all(), "rows of no sequence were written"
    ref, _ = reference.attention_varlen_ref(q, k, v, cq, ck, None, causal, dtype=torch.float32)
    if used.any():
        assert rel_err(out[used], ref[used]) < 8e-2, "fp8's own error bound (test_fp8_gpu REF_REL)"


@pytest.mark.parametrize("causal", [False, True])
def test_no_leaks(causal: bool) -> None:
    block_n = require_kernel(128, causal)
    torch.manual_seed(11)
    lens = [300, 129, 1000, 64]
    c = cu(lens)
    q, k, v = (tokens(sum(lens), h, 128) for h in (4, 2, 2))
    q8, k8, v8 = quantize_packed(q, k, v, c, c, block_n)
    out, lse = run_poisoned(q8, k8, v8, causal)
    for b in range(len(lens)):
        s0, s1 = int(c[b]), int(c[b + 1])
        # Other bytes in sequence b's rows, keys and V^T columns (no NaN: 0x7f/0xff excluded).
        def scramble(t: PackedFP8Tensor) -> PackedFP8Tensor:
            raw = t.data.view(torch.uint8).clone()
            junk = lambda n: torch.randint(0, 0x7E, n, dtype=torch.uint8, device=DEV)  # noqa: E731
            if t.transposed:
                c0 = (s0 // t.block_size + b) * t.block_size
                raw[:, :, c0:c0 + s1 - s0] = junk(raw[:, :, c0:c0 + s1 - s0].shape)
            else:
                raw[s0:s1] = junk(raw[s0:s1].shape)
            return t._replace(data=raw.view(torch.float8_e4m3fn))
        out2, lse2 = run_poisoned(scramble(q8), scramble(k8), scramble(v8), causal)
        others = torch.ones(q.shape[0], dtype=torch.bool, device=DEV)
        others[s0:s1] = False
        assert torch.equal(out2[others], out[others]) and torch.equal(lse2[:, others], lse[:, others]), \
            f"changing sequence {b} changed another's output"


def test_seqused() -> None:
    block_n = require_kernel(128, True)
    torch.manual_seed(12)
    lens = [300, 129, 1000, 64, 5]
    c = cu(lens)
    used = torch.tensor([1, 129, 700, 0, 5], dtype=torch.int32, device=DEV)
    q, k, v = (tokens(sum(lens), h, 128) for h in (4, 2, 2))
    q8, k8, v8 = quantize_packed(q, k, v, c, c, block_n)
    for causal in (False, True):
        out, lse = run_poisoned(q8, k8, v8, causal, used, used)
        want, want_lse = reference_fp8.attention_varlen_fp8_ref(q8, k8, v8, None, causal, seqused_q=used,
                                                                seqused_k=used)
        rows = torch.zeros(q.shape[0], dtype=torch.bool, device=DEV)
        for b, s0 in enumerate(c.tolist()[:-1]):
            rows[s0:s0 + int(used[b])] = True
        assert torch.isnan(out[~rows]).all(), "rows past seqused were written"
        # The reference rounds P against the final row max (test_fp8_gpu REF8_REL, REF8_LSE_ATOL).
        assert rel_err(out[rows], want[rows]) < 4e-2
        assert (lse[:, rows] - want_lse[:, rows]).abs().max().item() < 5e-3


def test_compile_and_graph_capture() -> None:
    require_kernel(128, True)
    torch.manual_seed(13)
    lens = [300, 1, 700]
    c = cu(lens)
    q, k, v = (tokens(sum(lens), h, 128) for h in (4, 4, 4))
    eager = flashhopper.flash_attn_varlen_fp8_func(q, k, v, c, c, 700, 700, causal=True)
    compiled = torch.compile(flashhopper.flash_attn_varlen_fp8_func, fullgraph=True)
    assert torch.equal(compiled(q, k, v, c, c, 700, 700, causal=True), eager)
    # The very first call of a new shape inside a capture: no host synchronization on the way.
    lens2 = [5, 40, 1000, 2]
    c2 = cu(lens2)
    q2, k2, v2 = (tokens(sum(lens2), 4, 128) for _ in range(3))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = flashhopper.flash_attn_varlen_fp8_func(q2, k2, v2, c2, c2, 1000, 1000, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    fresh = [tokens(sum(lens2), 4, 128) for _ in range(3)]
    for x, y in zip((q2, k2, v2), fresh):
        x.copy_(y)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, flashhopper.flash_attn_varlen_fp8_func(*fresh, c2, c2, 1000, 1000, causal=True))
