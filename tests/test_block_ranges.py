"""The kernels' block ranges (cpp/common/block_info.h, through _C.block_ranges) against a brute-force
walk of the visibility rule, for every tile shape the kernels use and every mask kind; no GPU needed.

For a query block m the forward visits key blocks [n_min, n_max); for a key block n the backward
visits query blocks [m_min, m_max). Checked over real rows r < seqlen_q and keys c < seqlen_k:
(a) every visible (r, c) lies in a visited block pair; (b) a visited pair that the ranges do not flag
as masked holds only visible pairs (forward: n in [n_left_masked_end, n_right_masked_begin) and not
the highest visited block n_max - 1, which is always masked for the sequence end; backward: m in
[m_right_masked_end, m_left_masked_begin) and the key block holds no key past seqlen_k); (c) the
forward and the backward visit the same pairs; (d) n_blocks_adding_to_dq (what the dQ counters wait
for) is n_max - n_min (at least 0), the number of key blocks whose backward range holds m.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from flashhopper import _ext

pytestmark = pytest.mark.skipif(not _ext.has_extension(),
                                reason=f"needs the compiled extension ({_ext.extension_error()})")

TILES = [(64, 64), (64, 80), (64, 128), (128, 64), (128, 80), (128, 128), (128, 192), (192, 128)]
MASKS = ["none", "causal", "window"]


def visibility(sq: int, sk: int, mask: str, left: int, right: int) -> np.ndarray:
    """(sq, sk) booleans straight from the rule: row r sees key c iff r + diag - left <= c <= r + diag + right,
    diag = sk - sq; "none" has neither edge, "causal" the right edge 0, "window" both (-1: unbounded)."""
    r = np.arange(sq)[:, None]
    c = np.arange(sk)[None, :]
    diag = sk - sq
    seen = np.ones((sq, sk), dtype=bool)
    if mask == "causal":
        seen &= c <= r + diag
    elif mask == "window":
        if right >= 0:
            seen &= c <= r + diag + right
        if left >= 0:
            seen &= c >= r + diag - left
    return seen


def per_block(v: np.ndarray, bm: int, bn: int, pad: bool, reduce: Any) -> np.ndarray:
    """(m blocks, n blocks) ``reduce`` (np.any / np.all) of ``v`` over each block, padded with ``pad``
    (padding rows and keys are no real pair)."""
    sq, sk = v.shape
    nm, nn = -(-sq // bm), -(-sk // bn)
    padded = np.full((nm * bm, nn * bn), pad)
    padded[:sq, :sk] = v
    return reduce(padded.reshape(nm, bm, nn, bn), axis=(1, 3))


def check(C: Any, bm: int, bn: int, mask: str, sq: int, sk: int, left: int = -1, right: int = -1) -> None:
    where = f"tile ({bm}, {bn}) mask {mask} seqlens ({sq}, {sk}) window ({left}, {right})"
    ranges = C.block_ranges(bm, bn, mask, sq, sk, left, right)
    fwd = np.array(ranges["fwd"], dtype=np.int64).reshape(-1, 5)
    bwd = np.array(ranges["bwd"], dtype=np.int64).reshape(-1, 4)
    nm, nn = -(-sq // bm), -(-sk // bn)
    assert fwd.shape[0] == nm and bwd.shape[0] == nn, where
    v = visibility(sq, sk, mask, left, right)
    any_visible = per_block(v, bm, bn, False, np.any)
    all_visible = per_block(v, bm, bn, True, np.all)
    m = np.arange(nm)[:, None]
    n = np.arange(nn)[None, :]

    n_min, n_max, right_begin, left_end, adding = (fwd[:, i, None] for i in range(5))
    visited_fwd = (n >= n_min) & (n < n_max)
    m_min, m_max, right_end, left_begin = (bwd[None, :, i] for i in range(4))
    visited_bwd = (m >= m_min) & (m < m_max)

    # (a) no visible pair outside the visited blocks
    missed = any_visible & ~visited_fwd
    assert not missed.any(), f"forward skips block pairs with visible keys {np.argwhere(missed)[:5].tolist()}: {where}"
    # (b) unmasked iterations hold only visible pairs
    unmasked_fwd = visited_fwd & (n >= left_end) & (n < right_begin) & (n < n_max - 1)
    bad = unmasked_fwd & ~all_visible
    assert not bad.any(), f"forward leaves block pairs unmasked {np.argwhere(bad)[:5].tolist()}: {where}"
    unmasked_bwd = visited_bwd & (m >= right_end) & (m < left_begin) & ((n + 1) * bn <= sk)
    bad = unmasked_bwd & ~all_visible
    assert not bad.any(), f"backward leaves block pairs unmasked {np.argwhere(bad)[:5].tolist()}: {where}"
    # (c) one set of visited pairs
    differ = visited_fwd != visited_bwd
    assert not differ.any(), f"forward and backward visit different pairs {np.argwhere(differ)[:5].tolist()}: {where}"
    # (d) the dQ counters' targets
    assert (adding[:, 0] == np.maximum(0, n_max - n_min)[:, 0]).all(), where
    assert (adding[:, 0] == visited_bwd.sum(axis=1)).all(), where


def random_edge(rng: random.Random) -> int:
    return rng.choice([-1, 0, rng.randint(1, 16), rng.randint(17, 400), rng.randint(400, 3000)])


def test_fixed_cases() -> None:
    # Empty sequences, one row or key, block-multiple and off-by-one lengths, windows of zero width,
    # wider than the sequences, and edges that leave rows without keys (sq > sk).
    C = _ext.extension()
    lengths = [0, 1, 63, 64, 65, 127, 128, 129, 191, 193, 700]
    windows = [(-1, -1), (-1, 0), (0, 0), (0, -1), (1, 1), (63, 64), (128, 0), (5000, 3), (3, 5000)]
    rng = random.Random(0)
    for bm, bn in TILES:
        for _ in range(12):
            sq, sk = rng.choice(lengths), rng.choice(lengths)
            check(C, bm, bn, "none", sq, sk)
            check(C, bm, bn, "causal", sq, sk)
            check(C, bm, bn, "window", sq, sk, *rng.choice(windows))


def test_random_cases() -> None:
    C = _ext.extension()
    rng = random.Random(19)
    for _ in range(600):
        bm, bn = rng.choice(TILES)
        mask = rng.choice(MASKS)
        sq, sk = rng.randint(0, 700), rng.randint(0, 700)
        left, right = (random_edge(rng), random_edge(rng)) if mask == "window" else (-1, -1)
        check(C, bm, bn, mask, sq, sk, left, right)


def test_split_ranges_tile_each_query_block() -> None:
    """Split-KV (KV caches): the splits' ranges of a query block are consecutive, in split order, and together exactly
    its forward range (none empty but at the end; a window's blocks, not the entry's, are what is split)."""
    C = _ext.extension()
    rng = random.Random(5)
    for _ in range(300):
        bm, bn = rng.choice(TILES)
        mask = rng.choice(MASKS)
        sq, sk = rng.randint(0, 300), rng.randint(0, 3000)
        left, right = (random_edge(rng), random_edge(rng)) if mask == "window" else (-1, -1)
        splits = rng.choice([1, 2, 3, 7, 64])
        ranges = C.block_ranges(bm, bn, mask, sq, sk, left, right, splits)
        for m, (fwd, parts) in enumerate(zip(ranges["fwd"], ranges["splits"])):
            n_min, n_max = fwd[0], fwd[1]
            where = f"tile ({bm}, {bn}) {mask} ({sq}, {sk}) window ({left}, {right}) splits {splits} block {m}"
            assert len(parts) == splits, where
            nonempty = [(a, b) for a, b in parts if b > a]
            if n_max <= n_min:
                assert not nonempty, where
                continue
            assert nonempty[0][0] == n_min and nonempty[-1][1] == n_max, where
            assert all(x[1] == y[0] for x, y in zip(nonempty, nonempty[1:])), where
            first_empty = next((i for i, (a, b) in enumerate(parts) if b <= a), splits)
            assert all(b <= a for a, b in parts[first_empty:]), where  # the empty ones come last


def test_brute_force_check_catches_wrong_ranges() -> None:
    # The check itself can fail: ranges off by one block, either way, do not pass it.
    C = _ext.extension()

    class Shifted:
        def __init__(self, column: int, delta: int) -> None:
            self.column, self.delta = column, delta

        def block_ranges(self, *args: Any) -> dict[str, Any]:
            r = C.block_ranges(*args)
            fwd = [list(t) for t in r["fwd"]]
            for t in fwd:
                t[self.column] += self.delta
            return {"fwd": [tuple(t) for t in fwd], "bwd": r["bwd"]}

    for column, delta in ((0, 1), (1, -1), (2, 1), (3, -1), (4, 1)):
        with pytest.raises(AssertionError):
            check(Shifted(column, delta), 128, 128, "window", 600, 650, 200, 100)
