"""Attention dropout's definition (flashhopper.dropout) and the reference with it: Philox4x32-R (at 10
rounds) against Random123's known answers, the mask's layout, keep rate and determinism, and the
reference's forward and backward with a dropout mask (float64 gradcheck, the expectation over seeds)."""
from __future__ import annotations

import math

import pytest
import torch

from flashhopper import flash_attn_func
from flashhopper.dropout import ROUNDS, Dropout, from_rng_state, keep_mask, new_rng_state, philox4x32
from flashhopper.reference import attention_bwd_ref, attention_ref, visible

# Random123's kat_vectors for philox4x32_10: (counter, key) -> output.
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("counter, key, want", KAT)
def test_philox_known_answers(counter: tuple[int, ...], key: tuple[int, int], want: tuple[int, ...]) -> None:
    got = philox4x32(tuple(torch.tensor(c) for c in counter), key)  # type: ignore[arg-type]
    assert tuple(int(x) for x in got) == want


def test_one_score_from_the_definition() -> None:
    # Score (row 21, key 37) of batch 1, head 2 (3 heads): block (1, 2), in-block (5, 5): pair indices
    # a = (5 % 8) // 2 = 2, b = 2; positions r = 2 * (5 >= 8) + 5 % 2 = 1, c = 1: byte 4 r + c = 5.
    d = Dropout(0.3, 0x0123456789ABCDEF, 11)
    words = philox4x32((torch.tensor(2 * 4 + 2), torch.tensor(1 * 4 + 2), torch.tensor(1 * 3 + 2),
                        torch.tensor(11)), (0x89ABCDEF, 0x01234567), ROUNDS)
    byte = (int(words[1]) >> 8) & 0xFF
    mask = keep_mask(d, 2, 3, 40, 50)
    assert bool(mask[1, 2, 21, 37]) == (byte >= round(0.3 * 256))


def test_keep_rate_and_determinism() -> None:
    d = Dropout(0.1, 2024, 5)
    m = keep_mask(d, 2, 4, 300, 500)
    n = m.numel()
    keep = (256 - round(0.1 * 256)) / 256
    assert abs(m.float().mean().item() - keep) < 5 * math.sqrt(keep * (1 - keep) / n)
    assert torch.equal(m, keep_mask(d, 2, 4, 300, 500))
    other = keep_mask(d._replace(offset=6), 2, 4, 300, 500)
    differ = (m != other).float().mean().item()  # independent draws: 2 keep (1 - keep)
    assert abs(differ - 2 * keep * (1 - keep)) < 0.01
    # Rows drawn alone are those rows of the whole; the mask does not depend on seqlen beyond them.
    assert torch.equal(keep_mask(d, 2, 4, 300, 500, rows=slice(37, 201)), m[:, :, 37:201])
    assert torch.equal(keep_mask(d, 2, 4, 100, 77), m[:, :, :100, :77])


def test_p_zero_and_one() -> None:
    assert bool(keep_mask(Dropout(0.0, 1, 0), 1, 1, 33, 33).all())
    assert not bool(keep_mask(Dropout(1.0, 1, 0), 1, 1, 33, 33).any())
    assert Dropout(0.1, 0, 0).scale() == 256 / 230


def dense_dropped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                            d: Dropout) -> torch.Tensor:
    """Independent of the reference's blocks: the whole score matrix, softmax, mask, P V."""
    b, sq, hq, dim = q.shape
    group = hq // k.shape[2]
    qt = q.transpose(1, 2)
    kt, vt = (x.transpose(1, 2).repeat_interleave(group, dim=1) for x in (k, v))
    s = qt @ kt.transpose(-1, -2) / math.sqrt(dim)
    vis = visible(sq, k.shape[1], causal, q.device)
    if vis is not None:
        s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    p = p * keep_mask(d, b, hq, sq, k.shape[1]) * d.scale()
    return (p @ vt).transpose(1, 2)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_forward(causal: bool) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 37, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, 45, 2, 8, dtype=torch.float64), torch.randn(2, 45, 2, 8, dtype=torch.float64)
    d = Dropout(0.2, 99, 1)
    out, lse = attention_ref(q, k, v, causal=causal, dropout=d)
    assert torch.allclose(out, dense_dropped_attention(q, k, v, causal, d), atol=1e-12)
    _, lse0 = attention_ref(q, k, v, causal=causal)
    assert torch.equal(lse, lse0)  # the softmax's normalizer sees every score


def test_reference_expectation_over_seeds() -> None:
    # E[out] is attention without dropout: the kept scores' scale makes it unbiased.
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 16, 1, 8, dtype=torch.float64) for _ in range(3))
    ref, _ = attention_ref(q, k, v)
    mean = sum(attention_ref(q, k, v, dropout=Dropout(0.25, s, 0))[0] for s in range(600)) / 600
    assert (mean - ref).abs().max().item() < 0.1 * ref.abs().max().item()


class _DroppedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, d):  # type: ignore[no-untyped-def]
        out, lse = attention_ref(q, k, v, causal=causal, dropout=d)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.d = causal, d
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[no-untyped-def]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_bwd_ref(dout, q, k, v, out, lse, None, ctx.causal, dropout=ctx.d)
        return dq, dk, dv, None, None


@pytest.mark.parametrize("causal", [False, True])
def test_reference_backward_gradcheck(causal: bool) -> None:
    # The backward formula with the same mask against finite differences of the forward (float64).
    torch.manual_seed(2)
    q = torch.randn(1, 9, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 11, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 11, 1, 4, dtype=torch.float64, requires_grad=True)
    d = Dropout(0.3, 7, 4)
    assert torch.autograd.gradcheck(lambda a, b, c: _DroppedAttention.apply(a, b, c, causal, d), (q, k, v))


def test_groups_are_whole_in_both_accumulator_layouts() -> None:
    # The layout's reason: in a 16 x 16 tile of an m16n8 (mma.sync) or m64nN (WGMMA, per 16 rows)
    # accumulator, thread t of a warp holds rows t // 4 and t // 4 + 8 and, per 8 columns, columns
    # 2 (t % 4) and 2 (t % 4) + 1. Every Philox group (16 scores) must be held by two threads as 8 scores
    # each, whether the tile is S (rows = queries) or S^T (rows = keys, the backward's layout), so that a
    # thread draws one Philox call per group and uses half of it.
    def held(t: int) -> set[tuple[int, int]]:
        rows = (t // 4, t // 4 + 8)
        cols = [8 * j + 2 * (t % 4) + e for j in range(2) for e in range(2)]
        return {(r, c) for r in rows for c in cols}

    def group(q: int, k: int) -> tuple[int, int]:
        return ((q % 8) // 2, (k % 8) // 2)

    for transposed in (False, True):
        owners: dict[tuple[int, int], list[int]] = {}
        for t in range(32):
            cells = held(t)
            if transposed:  # rows are keys: the thread's (key, query) cells as (query, key)
                cells = {(c, r) for r, c in cells}
            for g in {group(q, k) for q, k in cells}:
                owners.setdefault(g, []).append(sum(group(q, k) == g for q, k in cells))
        assert len(owners) == 16 and all(counts == [8, 8] for counts in owners.values()), owners


# --- the public path on CPU (the reference runs the ops) ---

def test_flash_attn_func_draws_from_the_generator() -> None:
    q, k, v = (torch.randn(2, 33, 4, 8, dtype=torch.float64) for _ in range(3))

    def run(seed: int) -> tuple[torch.Tensor, ...]:
        return flash_attn_func(q, k, v, causal=True, return_lse=True, dropout_p=0.3,
                               generator=torch.Generator().manual_seed(seed), return_dropout_mask=True)

    out, lse, mask = run(5)
    again, other = run(5), run(6)
    assert all(torch.equal(a, b) for a, b in zip((out, lse, mask), again))
    assert not torch.equal(mask, other[2])
    d = from_rng_state(0.3, new_rng_state(q.device, torch.Generator().manual_seed(5)))
    assert torch.equal(mask, keep_mask(d, 2, 4, 33, 33))
    assert torch.allclose(out, dense_dropped_attention(q, k, v, True, d), atol=1e-12)
    assert torch.equal(lse, flash_attn_func(q, k, v, causal=True, return_lse=True)[1])
    plain = flash_attn_func(q, k, v, causal=True, return_dropout_mask=True)
    assert bool(plain[1].all())  # no dropout: every score kept


def test_flash_attn_func_dropout_gradcheck() -> None:
    # Autograd through the op (the reference's backward with the saved (seed, offset)) against finite
    # differences, with one mask: each call draws from a generator seeded alike.
    torch.manual_seed(3)
    q = torch.randn(1, 9, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 11, 1, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 11, 1, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b, c: flash_attn_func(a, b, c, causal=True, dropout_p=0.4, generator=torch.Generator().manual_seed(1)),
        (q, k, v))
