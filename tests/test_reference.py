"""The references agree with each other and with an independent per-row float64 formula."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_matches_reference, randn_qkv, rel_err

from flashhopper.reference import attention_lowp, attention_ref, attention_tiled, visible

# (seqlen_q, seqlen_k): equal, one of them 1, sq < sk, sq > sk (with causal: rows that see no key),
# and lengths that are not multiples of any block size.
SEQLENS = [(1, 1), (1, 77), (77, 1), (37, 200), (200, 37), (128, 128), (65, 64)]
GQA = [(8, 8), (8, 2), (8, 1)]  # (nheads_q, nheads_kv): ratios 1, 4, 8
# flash-attn's (left, right), -1 unbounded: each edge alone, both, zero width, wider than any sequence.
WINDOWS = [(-1, 0), (0, 0), (3, -1), (-1, 2), (2, 5), (1000, 3)]


def sees(i: int, j: int, sq: int, sk: int, causal: bool, window: tuple[int, int] | None) -> bool:
    """Whether row i sees key j: bottom-right causal, and the window's two edges, checked one by one."""
    diag = i + sk - sq
    left, right = window if window is not None else (-1, -1)
    return ((not causal or j <= diag) and (left == -1 or j >= diag - left) and (right == -1 or j <= diag + right))


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                    window: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Row by row in numpy float64, straight from the definition; shares no code with flashhopper."""
    qn, kn, vn = (x.double().numpy() for x in (q, k, v))
    b, sq, hq, d = qn.shape
    sk, hkv = kn.shape[1], kn.shape[2]
    out = np.zeros((b, sq, hq, d))
    lse = np.full((b, hq, sq), -np.inf)
    for bi in range(b):
        for h in range(hq):
            g = h // (hq // hkv)
            for i in range(sq):
                keys = [j for j in range(sk) if sees(i, j, sq, sk, causal, window)]
                if not keys:
                    continue
                s = np.array([scale * float(np.dot(qn[bi, i, h], kn[bi, j, g])) for j in keys])
                w = np.exp(s - s.max())
                out[bi, i, h] = sum(wj * vn[bi, j, g] for wj, j in zip(w, keys)) / w.sum()
                lse[bi, h, i] = s.max() + math.log(w.sum())
    return out, lse


def assert_same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    # Both in float64: they differ only by summation order. -inf must match -inf exactly.
    torch.testing.assert_close(a[0], b[0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(a[1], b[1], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nheads", GQA)
@pytest.mark.parametrize("seqlens", SEQLENS)
def test_tiled_equals_exact(seqlens: tuple[int, int], nheads: tuple[int, int], causal: bool) -> None:
    q, k, v = randn_qkv(2, *seqlens, *nheads, 32, dtype=torch.float64)
    assert_same(attention_tiled(q, k, v, block_m=64, block_n=64, causal=causal),
                attention_ref(q, k, v, causal=causal))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blocks", [(1, 1), (16, 16), (32, 128), (128, 32), (7, 13), (512, 512)])
def test_tiled_block_sizes(blocks: tuple[int, int], causal: bool) -> None:
    for sq, sk in ((45, 100), (100, 45)):
        q, k, v = randn_qkv(1, sq, sk, 4, 2, 16, dtype=torch.float64)
        assert_same(attention_tiled(q, k, v, *blocks, causal=causal), attention_ref(q, k, v, causal=causal))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nheads", GQA)
@pytest.mark.parametrize("seqlens", [(1, 1), (1, 9), (9, 1), (5, 12), (12, 5), (16, 16)])
def test_exact_equals_naive(seqlens: tuple[int, int], nheads: tuple[int, int], causal: bool) -> None:
    q, k, v = randn_qkv(2, *seqlens, *nheads, 8, dtype=torch.float64)
    scale = 0.3
    out, lse = attention_ref(q, k, v, scale, causal)
    n_out, n_lse = naive_attention(q, k, v, scale, causal)
    torch.testing.assert_close(out, torch.from_numpy(n_out), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, torch.from_numpy(n_lse), atol=1e-12, rtol=1e-12)


def test_causal_is_bottom_right_aligned() -> None:
    # seqlen_q 4, seqlen_k 2: row i sees keys j <= i - 2, so rows 0-1 see nothing, row 2 sees key 0.
    q, k, v = randn_qkv(1, 4, 2, 1, 1, 8, dtype=torch.float64)
    mask = visible(4, 2, causal=True)
    assert mask is not None and mask.tolist() == [[False, False], [False, False], [True, False], [True, True]]
    out, lse = attention_ref(q, k, v, causal=True)
    assert (out[0, :2] == 0).all() and torch.isneginf(lse[0, 0, :2]).all()
    torch.testing.assert_close(out[0, 2], v[0, 0])  # one visible key: its value, exactly weighted by 1
    torch.testing.assert_close(lse[0, 0, 2], (q[0, 2, 0] @ k[0, 0, 0]) / math.sqrt(8))
    # seqlen_q 2, seqlen_k 4: row 0 sees keys 0..2, row 1 all four.
    mask = visible(2, 4, causal=True)
    assert mask is not None and mask.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert visible(3, 3, causal=False) is None


def test_lse_is_log_normalizer() -> None:
    q, k, v = randn_qkv(2, 33, 47, 4, 4, 16, dtype=torch.float64)
    out, lse = attention_ref(q, k, v, 0.25)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * 0.25
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))
    p = torch.exp(scores - lse[..., None])  # the softmax probabilities recovered from lse
    torch.testing.assert_close(out, torch.einsum("bhij,bjhd->bihd", p, v))


def test_row_blocks_of_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    # The exact reference walks query rows in blocks to bound memory; tiny blocks give the same answer.
    q, k, v = randn_qkv(2, 50, 30, 4, 2, 8, dtype=torch.float64)
    whole, whole_lowp = attention_ref(q, k, v, causal=True), attention_lowp(q, k, v, causal=True)
    monkeypatch.setattr("flashhopper.reference._MAX_SCORE_ELEMENTS", 2 * 4 * 30 * 7)  # 7 rows per block
    assert_same(attention_ref(q, k, v, causal=True), whole)
    assert_same(attention_lowp(q, k, v, causal=True), whole_lowp)


def test_float32_reference_is_close_to_float64() -> None:
    q, k, v = randn_qkv(1, 64, 64, 2, 2, 32)
    out32, lse32 = attention_ref(q, k, v, dtype=torch.float32)
    out64, lse64 = attention_ref(q, k, v)
    assert out32.dtype == torch.float32 and out64.dtype == torch.float64
    assert rel_err(out32, out64) < 1e-5 and rel_err(lse32, lse64) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lowp_error_is_the_input_precision(dtype: torch.dtype) -> None:
    # The yardstick must be neither exact (it would make the kernel tolerance zero) nor garbage.
    q, k, v = randn_qkv(1, 100, 120, 4, 2, 64, dtype=dtype)
    out, lse = attention_lowp(q, k, v, causal=True)
    ref, ref_lse = attention_ref(q, k, v, causal=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    eps = torch.finfo(dtype).eps
    assert eps / 16 < rel_err(out, ref) < 8 * eps
    assert rel_err(lse, ref_lse) < 8 * eps


@pytest.mark.parametrize("fn", [attention_ref, attention_tiled, attention_lowp])
def test_no_keys_gives_zeros_and_neg_inf(fn) -> None:  # type: ignore[no-untyped-def]
    q, k, v = randn_qkv(2, 5, 0, 4, 2, 8)
    out, lse = fn(q, k, v)
    assert out.shape == q.shape and (out == 0).all()
    assert lse.shape == (2, 4, 5) and torch.isneginf(lse).all()


# --- local windows ---

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("seqlens", [(9, 9), (5, 12), (12, 5), (1, 7)])
def test_window_equals_naive(seqlens: tuple[int, int], window: tuple[int, int], causal: bool) -> None:
    q, k, v = randn_qkv(2, *seqlens, 4, 2, 8, dtype=torch.float64)
    out, lse = attention_ref(q, k, v, 0.3, causal, window=window)
    n_out, n_lse = naive_attention(q, k, v, 0.3, causal, window)
    torch.testing.assert_close(out, torch.from_numpy(n_out), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, torch.from_numpy(n_lse), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS + [(17, 40)])
def test_visible_window(window: tuple[int, int], causal: bool) -> None:
    for sq, sk in ((1, 1), (30, 30), (20, 45), (45, 20), (0, 5), (5, 0)):
        mask = visible(sq, sk, causal, window=window)
        want = [[sees(i, j, sq, sk, causal, window) for j in range(sk)] for i in range(sq)]
        assert mask is not None and mask.tolist() == want, (sq, sk)
        if sq >= 11:  # row blocks of the mask are the mask's rows
            assert visible(sq, sk, causal, None, slice(3, 11), window=window).tolist() == want[3:11]  # type: ignore[union-attr]


def test_window_conventions() -> None:
    # (-1, -1) is no window; (-1, 0) is causal; with causal the right edge is min(right, 0).
    assert visible(6, 9, False, window=(-1, -1)) is None
    assert torch.equal(visible(6, 9, False, window=(-1, 0)), visible(6, 9, True))  # type: ignore[arg-type]
    assert torch.equal(visible(6, 9, True, window=(-1, 4)), visible(6, 9, True))  # type: ignore[arg-type]
    assert torch.equal(visible(6, 9, True, window=(2, 7)), visible(6, 9, False, window=(2, 0)))  # type: ignore[arg-type]
    # (0, 0): each row sees its diagonal key only (bottom-right: row i, key i + 3), where it exists.
    assert visible(6, 9, False, window=(0, 0)).nonzero().tolist() == [[i, i + 3] for i in range(6)]  # type: ignore[union-attr]
    assert visible(9, 6, False, window=(0, 0)).nonzero().tolist() == [[i, i - 3] for i in range(3, 9)]  # type: ignore[union-attr]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("blocks", [(16, 16), (7, 13), (64, 64)])
def test_tiled_window(blocks: tuple[int, int], window: tuple[int, int], causal: bool) -> None:
    for sq, sk in ((45, 100), (100, 45), (64, 64)):
        q, k, v = randn_qkv(1, sq, sk, 4, 2, 16, dtype=torch.float64)
        assert_same(attention_tiled(q, k, v, *blocks, causal=causal, window=window),
                    attention_ref(q, k, v, causal=causal, window=window))


@pytest.mark.parametrize("window", [(0, 0), (5, 2)])
def test_window_rows_without_keys(window: tuple[int, int]) -> None:
    # seqlen_q 12 > seqlen_k 4: rows 0..7 have their diagonal before key 0; with a small right edge the
    # first ones see nothing: out exactly 0, lse -inf, in every reference.
    q, k, v = randn_qkv(1, 12, 4, 2, 2, 8)
    none = ~visible(12, 4, False, window=window).any(1)  # type: ignore[union-attr]
    assert none.any() and not none.all()
    for out, lse in (attention_ref(q, k, v, window=window), attention_lowp(q, k, v, window=window),
                     attention_tiled(q, k, v, 4, 2, window=window)):
        assert (out[:, none] == 0).all() and torch.isneginf(lse[:, :, none]).all()
        assert torch.isfinite(lse[:, :, ~none]).all()


# --- the GPU tests' forward assertion, on a CPU emulation of a kernel ---

def emulated_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                    window: tuple[int, int] | None = None, bug: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A faithful forward as a kernel returns it: float32 math, out rounded to q.dtype, float32 lse.
    ``bug`` injects one mistake."""
    out32, lse = attention_ref(q, k, v, scale * (1.01 if bug == "scale 1% off" else 1.0), causal,
                               window=None if bug == "window ignored" else window, dtype=torch.float32)
    out = out32.to(q.dtype)
    if bug == "one wrong row":  # e.g. a row written from another query's accumulator
        out[:, 5] = out[:, 6]
    elif bug == "lse in base 2":  # the kernels work in log2; forgetting to convert back
        lse = lse * math.log2(math.e)
    elif bug == "one lse off":
        lse[0, 0, 3] += 0.05
    elif bug == "a NaN":
        out[0, -1, 0, 0] = math.nan
    elif bug == "last row dropped":  # as if the last query block's tail were skipped: looks keyless
        out[:, -1] = 0
        lse[:, :, -1] = -math.inf
    elif bug == "no-key rows not zero":
        out = out + (1e-3 * torch.randn_like(out32)).to(q.dtype)  # small, everywhere, including rows without keys
    return out, lse.float()


FWD_CASES = [(2, 70, 130, 4, 2, 64, True, None), (1, 130, 70, 4, 1, 64, True, None),
             (1, 90, 90, 4, 4, 64, False, (8, 8)), (2, 130, 70, 4, 2, 64, False, (16, 0)),
             (1, 300, 1, 4, 1, 128, False, None)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", FWD_CASES)
def test_assertion_accepts_a_faithful_kernel(case: tuple[Any, ...], dtype: torch.dtype) -> None:
    b, sq, sk, hq, hkv, d, causal, window = case
    q, k, v = randn_qkv(b, sq, sk, hq, hkv, d, dtype=dtype)
    out, lse = emulated_kernel(q, k, v, 1 / math.sqrt(d), causal, window)
    assert_matches_reference(out, lse, q, k, v, None, causal, window=window)


@pytest.mark.parametrize(("bug", "case"), [
    ("one wrong row", FWD_CASES[0]),
    ("lse in base 2", FWD_CASES[2]),
    ("one lse off", FWD_CASES[0]),
    ("a NaN", FWD_CASES[3]),
    ("last row dropped", FWD_CASES[1]),
    ("no-key rows not zero", FWD_CASES[1]),  # sq > sk, causal: rows 0..59 see no key
    ("scale 1% off", FWD_CASES[0]),
    ("window ignored", FWD_CASES[2]),
    ("window ignored", FWD_CASES[3]),
])
def test_assertion_rejects_a_broken_kernel(bug: str, case: tuple[Any, ...]) -> None:
    b, sq, sk, hq, hkv, d, causal, window = case
    q, k, v = randn_qkv(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16)
    out, lse = emulated_kernel(q, k, v, 1 / math.sqrt(d), causal, window, bug=bug)
    with pytest.raises(AssertionError):
        assert_matches_reference(out, lse, q, k, v, None, causal, window=window)
