"""Packed-batch (varlen) forward and backward kernels against per-sequence exact attention on the GPU
(skipped here).

Each case packs sequences of the given lengths (q and k lengths per sequence, GQA, head dim, dtype,
causal) and checks every sequence's rows of out and lse with FA3's criterion (helpers.
assert_matches_reference on that sequence alone). Outputs are poisoned with NaN before the run; rows in
no sequence's used range must still hold the poison afterwards (the kernels never write them). The leak
tests change, or fill with NaN/inf, a neighbour's tokens and require every other sequence's output to stay
bitwise the same: per-sequence tensor maps mean a tile never reads or writes another sequence's rows.
"""
from __future__ import annotations

import random

import pytest
import torch
from helpers import assert_grads_match_or_control, assert_matches_reference, require_backend

from flashhopper import flash_attn_func, flash_attn_varlen_func
from flashhopper.kernel_key import VARLEN_HEADDIMS
from flashhopper.varlen import _launch_varlen_bwd, _launch_varlen_fwd

pytestmark = pytest.mark.gpu

BACKEND = "sm90"
BACKENDS = ["sm90", "sm80"]  # the Ampere kernels run on Hopper too (the build has their sm_90 code)
ARCH = {"sm90": 90, "sm80": 80}
NHEADS_Q = 4

# (q lengths, k lengths or None: the same). Empty and one-token sequences, lengths that straddle the
# tiles (128 query rows, 80-176 keys), a long sequence among short ones, more keys than queries and fewer.
LENGTHS = [
    ([1], None),
    ([0, 5, 0], None),
    ([17, 128, 129, 255, 1], None),
    ([1000, 3, 300, 64], None),
    ([3000, 1, 2, 7, 65, 500], None),
    ([100, 200, 5], [300, 17, 5]),
    ([40, 1, 700], [0, 9, 1500]),
]
DTYPES = [torch.bfloat16, torch.float16]


def cu(lengths: list[int], device: str = "cuda") -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def packed(lq: list[int], lk: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, pad: int = 0):
    """q, k, v of the packed batch (with ``pad`` spare rows at the end of each), and the cu_seqlens."""
    q = torch.randn(sum(lq) + pad, hq, d, dtype=dtype, device="cuda")
    k = torch.randn(sum(lk) + pad, hkv, d, dtype=dtype, device="cuda")
    v = torch.randn(sum(lk) + pad, hkv, d, dtype=dtype, device="cuda")
    return q, k, v, cu(lq), cu(lk)


def launch_poisoned(q, k, v, cq, ck, causal, seqused_q=None, seqused_k=None, window=None, softcap=0.0, sinks=None,
                    backend=BACKEND):
    """out and lse (NaN before the launch) and the forward's grid (CTAs)."""
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32, device="cuda")
    lq = (cq[1:] - cq[:-1]) if seqused_q is None else seqused_q
    lk = (ck[1:] - ck[:-1]) if seqused_k is None else seqused_k
    grid = _launch_varlen_fwd(q, k, v, cq, ck, seqused_q, seqused_k, int(lq.max()) if lq.numel() else 0,
                              int(lk.max()) if lk.numel() else 0, out, lse, q.shape[-1] ** -0.5, causal, window,
                              softcap, sinks, ARCH[backend])
    return out, lse, grid


def run_poisoned(q, k, v, cq, ck, causal, seqused_q=None, seqused_k=None, window=None, softcap=0.0, sinks=None,
                 backend=BACKEND):
    out, lse, _ = launch_poisoned(q, k, v, cq, ck, causal, seqused_q, seqused_k, window, softcap, sinks, backend)
    return out, lse


def check_sequences(out, lse, q, k, v, cq, ck, causal, seqused_q=None, seqused_k=None, window=None, softcap=0.0,
                    sinks=None):
    starts_q, starts_k = cq.tolist(), ck.tolist()
    used = torch.zeros(q.shape[0], dtype=torch.bool)
    for b in range(len(starts_q) - 1):
        oq, ok = starts_q[b], starts_k[b]
        nq = starts_q[b + 1] - oq if seqused_q is None else int(seqused_q[b])
        nk = starts_k[b + 1] - ok if seqused_k is None else int(seqused_k[b])
        used[oq:oq + nq] = True
        if nq == 0:
            continue
        assert_matches_reference(out[None, oq:oq + nq], lse[None, :, oq:oq + nq], q[None, oq:oq + nq],
                                 k[None, ok:ok + nk], v[None, ok:ok + nk], None, causal, window=window,
                                 softcap=softcap, sinks=sinks)
    unused = ~used.cuda()
    assert torch.isnan(out[unused]).all(), "rows in no sequence's used range were written"
    assert torch.isnan(lse[:, unused]).all(), "lse of rows in no sequence's used range was written"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", list(VARLEN_HEADDIMS))
@pytest.mark.parametrize("case", range(len(LENGTHS)))
def test_varlen_matches_reference(case: int, d: int, causal: bool, backend: str) -> None:
    dtype = DTYPES[(case + d) % 2]
    require_backend(backend, dtype, d, causal, varlen=True)
    lq, lk = LENGTHS[case]
    lk = lq if lk is None else lk
    gqa = [1, 2, 4][case % 3]
    torch.manual_seed(case * 1000 + d)
    q, k, v, cq, ck = packed(lq, lk, NHEADS_Q, NHEADS_Q // gqa, d, dtype, pad=case % 2 * 37)
    out, lse = run_poisoned(q, k, v, cq, ck, causal, backend=backend)
    check_sequences(out, lse, q, k, v, cq, ck, causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_seqused(causal: bool, backend: str) -> None:
    require_backend(backend, torch.bfloat16, 128, causal, varlen=True)
    torch.manual_seed(7)
    slots_q, slots_k = [300, 64, 1, 500], [400, 64, 9, 128]
    q, k, v, cq, ck = packed(slots_q, slots_k, NHEADS_Q, 2, 128, torch.bfloat16)
    used_q = torch.tensor([129, 0, 1, 500], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([400, 5, 0, 77], dtype=torch.int32, device="cuda")
    # What the slots hold past seqused must not matter: NaN there.
    for x, c, u in ((k, ck, used_k), (v, ck, used_k)):
        for b, (s, n) in enumerate(zip(c.tolist(), u.tolist())):
            x[s + n:c[b + 1]] = float("nan")
    out, lse = run_poisoned(q, k, v, cq, ck, causal, used_q, used_k, backend=backend)
    check_sequences(out, lse, q, k, v, cq, ck, causal, used_q, used_k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", list(VARLEN_HEADDIMS))
def test_no_leak_between_sequences(d: int, causal: bool, backend: str) -> None:
    """Changing one sequence's q/k/v, or filling them with NaN and inf, leaves every other sequence's out and
    lse bitwise the same (no tile reads a neighbour's rows; a NaN read would spread through P = 0 times V)."""
    require_backend(backend, torch.bfloat16, d, causal, varlen=True)
    torch.manual_seed(d)
    lengths = [130, 77, 1, 300, 64]
    q, k, v, cq, ck = packed(lengths, lengths, NHEADS_Q, 2, d, torch.bfloat16)
    out0, lse0 = run_poisoned(q, k, v, cq, ck, causal, backend=backend)
    starts = cq.tolist()
    for victim, fill in ((1, None), (3, float("nan")), (0, float("inf")), (4, float("nan"))):
        rows = slice(starts[victim], starts[victim + 1])
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        for x in (q2, k2, v2):
            if fill is None:
                x[rows] = torch.randn_like(x[rows])
            else:
                x[rows] = fill
        out, lse = run_poisoned(q2, k2, v2, cq, ck, causal, backend=backend)
        keep = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
        keep[rows] = False
        assert torch.equal(out[keep], out0[keep]), f"sequence {victim} changed ({fill}): another's out changed"
        assert torch.equal(lse[:, keep], lse0[:, keep]), f"sequence {victim} changed ({fill}): another's lse changed"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_equal_lengths_match_dense(causal: bool, backend: str) -> None:
    """Equal lengths: the same tiles as the padded-batch kernel, so the same numbers."""
    require_backend(backend, torch.bfloat16, 128, causal, varlen=True)
    require_backend(backend, torch.bfloat16, 128, causal)
    torch.manual_seed(3)
    b, s, hq, hkv, d = 3, 1000, 8, 2, 128
    q = torch.randn(b, s, hq, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b, s, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(b, s, hkv, d, dtype=torch.bfloat16, device="cuda")
    dense, dense_lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, backend=backend)
    c = cu([s] * b)
    out, lse = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), c, c, s, s, causal=causal,
                                      return_lse=True, backend=backend)
    assert torch.equal(out.view(b, s, hq, d), dense)
    assert torch.equal(lse.view(hq, b, s).transpose(0, 1), dense_lse)


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_short_sequences(backend: str) -> None:
    require_backend(backend, torch.float16, 64, True, varlen=True)
    rng = random.Random(5)
    lengths = [rng.randint(0, 16) for _ in range(3000)]
    torch.manual_seed(5)
    q, k, v, cq, ck = packed(lengths, lengths, NHEADS_Q, 1, 64, torch.float16)
    out, lse = run_poisoned(q, k, v, cq, ck, True, backend=backend)
    # Every 97th sequence against the reference, and nothing left unwritten.
    starts = cq.tolist()
    for b in range(0, len(lengths), 97):
        s, n = starts[b], lengths[b]
        if n:
            assert_matches_reference(out[None, s:s + n], lse[None, :, s:s + n], q[None, s:s + n], k[None, s:s + n],
                                     v[None, s:s + n], None, True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["window", "softcap", "sinks"])
def test_model_variants(variant: str, backend: str) -> None:
    """Window, softcap and sinks plug into the packed kernels as into the padded ones."""
    window = (100, 0) if variant == "window" else None
    softcap = 20.0 if variant == "softcap" else 0.0
    require_backend(backend, torch.bfloat16, 128, True, window=window, softcap=softcap, varlen=True)
    torch.manual_seed(11)
    lengths = [700, 1, 129, 300]
    q, k, v, cq, ck = packed(lengths, lengths, NHEADS_Q, 2, 128, torch.bfloat16)
    sinks = torch.randn(NHEADS_Q, device="cuda") if variant == "sinks" else None
    out, lse = run_poisoned(q, k, v, cq, ck, True, window=window, softcap=softcap, sinks=sinks, backend=backend)
    check_sequences(out, lse, q, k, v, cq, ck, True, window=window, softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("backend", BACKENDS)
def test_64bit_offsets(backend: str) -> None:
    """More than 2^31 elements before the last sequences' rows (32 heads x 128 = 4096 per token)."""
    require_backend(backend, torch.bfloat16, 128, True, varlen=True)
    hq, d = 32, 128
    lengths = [65536] * 8 + [1000, 3, 2049]
    total = sum(lengths)
    assert total * hq * d > 2**31
    torch.manual_seed(13)
    q, k, v, cq, ck = packed(lengths, lengths, hq, 8, d, torch.bfloat16)
    out, lse = run_poisoned(q, k, v, cq, ck, True, backend=backend)
    starts = cq.tolist()
    for b in (len(lengths) - 3, len(lengths) - 2, len(lengths) - 1):
        s, n = starts[b], lengths[b]
        assert_matches_reference(out[None, s:s + n], lse[None, :, s:s + n], q[None, s:s + n], k[None, s:s + n],
                                 v[None, s:s + n], None, True)
    assert not torch.isnan(out).any()


def test_cuda_graph_replay_with_new_lengths() -> None:
    """Captured once, replayed with other cu_seqlens values (same batch): equal to eager each time."""
    require_backend(BACKEND, torch.bfloat16, 128, True, varlen=True)
    torch.manual_seed(17)
    total, batch = 2048, 5
    q = torch.randn(total, NHEADS_Q, 128, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn_like(q), torch.randn_like(q)
    cq = cu([400, 400, 400, 400, 448])
    flash_attn_varlen_func(q, k, v, cq, cq, 2048, 2048, causal=True)  # warm up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = flash_attn_varlen_func(q, k, v, cq, cq, 2048, 2048, causal=True)
    for lengths in ([1000, 1, 0, 47, 1000], [2048, 0, 0, 0, 0], [100, 200, 300, 400, 500]):
        cq.copy_(cu(lengths))
        g.replay()
        eager = flash_attn_varlen_func(q, k, v, cq, cq, 2048, 2048, causal=True)
        n = sum(lengths)
        assert torch.equal(out[:n], eager[:n]), f"graph replay differs from eager for lengths {lengths}"
    assert batch == cq.shape[0] - 1


def test_compile_fullgraph() -> None:
    require_backend(BACKEND, torch.bfloat16, 64, False, varlen=True)
    torch.manual_seed(19)
    lengths = [300, 1, 77]
    q, k, v, cq, ck = packed(lengths, lengths, NHEADS_Q, 4, 64, torch.bfloat16)

    def f(q, k, v, cq, ck):
        return flash_attn_varlen_func(q, k, v, cq, ck, 300, 300) * 2

    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(q, k, v, cq, ck), f(q, k, v, cq, ck))


def test_public_call() -> None:
    require_backend(BACKEND, torch.bfloat16, 128, False, varlen=True)
    lengths = [10, 20]
    q, k, v, cq, ck = packed(lengths, lengths, NHEADS_Q, 4, 128, torch.bfloat16)
    out, lse = flash_attn_varlen_func(q, k, v, cq, ck, 20, 20, return_lse=True)
    assert out.shape == q.shape and lse.shape == (NHEADS_Q, 30) and lse.dtype == torch.float32


# --- backward ---

# CTA pairs (cpp/sm90/tile_size.h: CtaPairs): the non-causal 16-bit forward at head dims 128 and 256 runs in two-CTA
# clusters once the longest entry has PAIRS_FROM_KEYS keys and either every entry has the longest's rows, an even
# number of blocks, or the entries average PAIRS_MEAN_BLOCKS blocks (launch_fwd.h: use_cta_pairs), both CTAs of a
# cluster on one (entry, head) and neighbouring query blocks (tile_scheduler.h: VarlenPairScheduler). An entry of an
# odd number of 128-row blocks gives its last pair's second CTA a block past its rows, which loads and computes but
# must store nothing: odd and even block counts (12000: 94, 1: 1, whose past block lies in the next entry's rows,
# 20800: 163), an empty entry, and the odd one last, whose past block lies in the spare rows after the batch
# (poisoned, checked). Averaging 64 blocks makes these batches long.
PAIRS_FROM_KEYS = 2048
PAIR_BLOCK_M = 128
PAIRS_MEAN_BLOCKS = 64
PAIR_LENGTHS = [12000, 1, 0, 20800]
PAIR_PAD = 300


@pytest.fixture
def odd_sms(monkeypatch):
    """The launches see an odd SM count (131): the one-CTA kernel's persistent grid of a large batch is then odd and
    the pair kernel's always even, which tells them apart where both would fill the device."""
    from flashhopper import _launch

    fill = _launch.fill_device

    def fill_odd(p, x):
        fill(p, x)
        if hasattr(p, "num_sms"):
            p.num_sms = 131

    monkeypatch.setattr(_launch, "fill_device", fill_odd)


def assert_paired(grid: int) -> None:
    assert grid % 2 == 0 and grid <= 130, f"grid {grid}: the one-CTA kernel ran, not the pairs"


def pair_grid(total_q: int, batch: int, heads: int) -> int:
    """The pair kernel's grid where the device holds that many clusters: two CTAs per unit of the host's bound
    (launch_fwd.h: an entry wastes at most one partial unit of two query blocks)."""
    return 2 * (-(-total_q // (2 * PAIR_BLOCK_M)) + batch) * heads


@pytest.mark.parametrize("hkv", [NHEADS_Q, 1], ids=["mha", "gqa4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [128, 256])
def test_cta_pairs_match_reference(d: int, dtype: torch.dtype, hkv: int, odd_sms) -> None:
    require_backend(BACKEND, dtype, d, False, varlen=True)
    torch.manual_seed(d + hkv)
    q, k, v, cq, ck = packed(PAIR_LENGTHS, PAIR_LENGTHS, NHEADS_Q, hkv, d, dtype, pad=PAIR_PAD)
    out, lse, grid = launch_poisoned(q, k, v, cq, ck, False)
    assert_paired(grid)
    check_sequences(out, lse, q, k, v, cq, ck, False)


@pytest.mark.parametrize("d", [128, 256])
def test_cta_pairs_small(d: int) -> None:
    """A small batch that runs in pairs (for the sanitizers): equal entries of an even block count (2304: 18), GQA;
    then the same batch run again gives the same bits (a static schedule). (Odd entries run in pairs only in batches
    averaging 64 blocks: the tests above.)"""
    require_backend(BACKEND, torch.bfloat16, d, False, varlen=True)
    torch.manual_seed(11)
    lengths = [2304, 2304]
    q, k, v, cq, ck = packed(lengths, lengths, 2, 1, d, torch.bfloat16)  # no spare rows: they turn equal rows off
    out, lse, grid = launch_poisoned(q, k, v, cq, ck, False)
    assert grid == pair_grid(q.shape[0], len(lengths), 2)
    check_sequences(out, lse, q, k, v, cq, ck, False)
    out2, lse2, _ = launch_poisoned(q, k, v, cq, ck, False)
    assert torch.equal(out.view(torch.int16), out2.view(torch.int16))
    assert torch.equal(lse.view(torch.int32), lse2.view(torch.int32))


@pytest.mark.parametrize("d", [128, 256])
def test_cta_pairs_small_odd(d: int) -> None:
    """The smallest odd entry that runs in pairs (for the sanitizers): 8320 rows, 65 blocks (64 on average), one head,
    whose last pair's past block lies in the poisoned spare rows after it (told from one CTA by the grid: 70 / 68)."""
    require_backend(BACKEND, torch.bfloat16, d, False, varlen=True)
    torch.manual_seed(13)
    lengths = [PAIRS_MEAN_BLOCKS * PAIR_BLOCK_M + PAIR_BLOCK_M]
    q, k, v, cq, ck = packed(lengths, lengths, 1, 1, d, torch.bfloat16, pad=200)
    out, lse, grid = launch_poisoned(q, k, v, cq, ck, False)
    assert grid == pair_grid(q.shape[0], len(lengths), 1)
    check_sequences(out, lse, q, k, v, cq, ck, False)


@pytest.mark.parametrize("d", [128, 256])
def test_cta_pairs_engage(d: int) -> None:
    """Pairs from PAIRS_FROM_KEYS keys in the longest entry where its block count is even and every entry has its rows;
    one CTA a tile below, at an odd count, or for unequal entries averaging few blocks (told apart by the grid: a pair
    per unit of two blocks against a CTA per block), all matching the reference."""
    require_backend(BACKEND, torch.bfloat16, d, False, varlen=True)
    heads = NHEADS_Q
    if torch.cuda.get_device_properties(0).multi_processor_count < 100:  # the largest grid below, one CTA's
        pytest.skip("fewer SMs than the grid this test tells the kernels apart by")
    torch.manual_seed(d)
    for lengths, pairs in (([PAIRS_FROM_KEYS + 256], True), ([PAIRS_FROM_KEYS + 52], False),
                           ([PAIRS_FROM_KEYS + 256, 640], False), ([PAIRS_FROM_KEYS - 1, 5], False)):
        q, k, v, cq, ck = packed(lengths, lengths, heads, 2, d, torch.bfloat16)
        out, lse, grid = launch_poisoned(q, k, v, cq, ck, False)
        one_cta = (-(-sum(lengths) // PAIR_BLOCK_M) + len(lengths)) * heads
        assert grid == (pair_grid(sum(lengths), len(lengths), heads) if pairs else one_cta), (lengths, grid)
        check_sequences(out, lse, q, k, v, cq, ck, False)


def test_cta_pairs_seqused(odd_sms) -> None:
    """Slots longer than their entries (averaging 64 blocks of slot rows): an odd entry's past block (16500 of 20000:
    block 129 of 157) lies in its slot's unused rows, which must keep their poison; keys past seqused_k are NaN."""
    require_backend(BACKEND, torch.bfloat16, 128, False, varlen=True)
    torch.manual_seed(5)
    slots = [20000, 13000, 520, 300]
    assert sum(slots) >= len(slots) * PAIRS_MEAN_BLOCKS * PAIR_BLOCK_M
    q, k, v, cq, ck = packed(slots, slots, NHEADS_Q, 2, 128, torch.bfloat16)
    used = torch.tensor([16500, 11900, 300, 0], dtype=torch.int32, device="cuda")
    for x in (k, v):
        for b, (s, n) in enumerate(zip(ck.tolist(), used.tolist())):
            x[s + n:ck[b + 1]] = float("nan")
    out, lse, grid = launch_poisoned(q, k, v, cq, ck, False, used, used)
    assert_paired(grid)
    check_sequences(out, lse, q, k, v, cq, ck, False, used, used)


@pytest.mark.parametrize("d", [128, 256])
def test_cta_pairs_no_leak(d: int, odd_sms) -> None:
    """As test_no_leak_between_sequences, in pairs: new tokens, NaN or inf in one entry (odd block counts among them,
    whose past blocks reach into the next entry's rows) leave every other entry's out and lse bitwise the same."""
    require_backend(BACKEND, torch.bfloat16, d, False, varlen=True)
    torch.manual_seed(d + 1)
    lengths = [16500, 300, 20600, 1, 4000]  # averaging 64 blocks; 129, 3, 161, 1 and 32 blocks
    q, k, v, cq, ck = packed(lengths, lengths, NHEADS_Q, 2, d, torch.bfloat16)
    out0, lse0, grid = launch_poisoned(q, k, v, cq, ck, False)
    assert_paired(grid)
    check_sequences(out0, lse0, q, k, v, cq, ck, False)
    starts = cq.tolist()
    for victim, fill in ((1, None), (1, float("nan")), (0, float("inf")), (3, float("nan")), (2, None)):
        rows = slice(starts[victim], starts[victim + 1])
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        for x in (q2, k2, v2):
            x[rows] = torch.randn_like(x[rows]) if fill is None else fill
        out, lse = run_poisoned(q2, k2, v2, cq, ck, False)
        keep = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
        keep[rows] = False
        assert torch.equal(out[keep], out0[keep]), f"entry {victim} changed ({fill}): another's out changed"
        assert torch.equal(lse[:, keep], lse0[:, keep]), f"entry {victim} changed ({fill}): another's lse changed"


@pytest.mark.parametrize(("d", "batch"), [(128, 129), (256, 57)])
def test_cta_pairs_many_entries(d: int, batch: int, odd_sms) -> None:
    """More entries than the producer's shared-memory copy of the schedule holds (128 at head dim 128, ~56 at 256):
    the pairs decode units from global memory."""
    require_backend(BACKEND, torch.bfloat16, d, False, varlen=True)
    torch.manual_seed(batch)
    lengths = [PAIRS_FROM_KEYS] * batch
    q, k, v, cq, ck = packed(lengths, lengths, 2, 1, d, torch.bfloat16)
    out, lse, grid = launch_poisoned(q, k, v, cq, ck, False)
    assert_paired(grid)
    check_sequences(out, lse, q, k, v, cq, ck, False)


def test_cta_pairs_graph_replay_with_new_lengths() -> None:
    """Captured in pairs (equal entries of an even block count), replayed with other cu_seqlens values, odd entries
    among them: equal to eager (the same kernel, a static order) and to the reference."""
    require_backend(BACKEND, torch.bfloat16, 128, False, varlen=True)
    torch.manual_seed(19)
    top, batch = PAIRS_FROM_KEYS, 2
    q = torch.randn(top * batch, NHEADS_Q, 128, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn_like(q), torch.randn_like(q)
    cq = cu([top] * batch)
    flash_attn_varlen_func(q, k, v, cq, cq, top, top)  # warm up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = flash_attn_varlen_func(q, k, v, cq, cq, top, top, return_lse=True)
    for lengths in ([top - 1, 1], [1000, 3], [0, top], [top, top]):
        cq.copy_(cu(lengths))
        g.replay()
        eager = flash_attn_varlen_func(q, k, v, cq, cq, top, top)
        n = sum(lengths)
        assert torch.equal(out[:n], eager[:n]), f"graph replay differs from eager for lengths {lengths}"
        starts = cq.tolist()
        for b, m in enumerate(lengths):
            if m:
                s = starts[b]
                assert_matches_reference(out[None, s:s + m], lse[None, :, s:s + m], q[None, s:s + m],
                                         k[None, s:s + m], v[None, s:s + m], None, False)


@pytest.mark.parametrize("seqlen", [2048, 4096])
def test_cta_pairs_equal_lengths_match_dense(seqlen: int) -> None:
    """Equal lengths of an even number of blocks: both kernels in pairs, the same tiles, so the same numbers."""
    require_backend(BACKEND, torch.bfloat16, 128, False, varlen=True)
    require_backend(BACKEND, torch.bfloat16, 128, False)
    torch.manual_seed(seqlen)
    b, hq, hkv, d = 2, 8, 2, 128
    q = torch.randn(b, seqlen, hq, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b, seqlen, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(b, seqlen, hkv, d, dtype=torch.bfloat16, device="cuda")
    dense, dense_lse = flash_attn_func(q, k, v, return_lse=True, backend=BACKEND)
    c = cu([seqlen] * b)
    out, lse = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), c, c, seqlen, seqlen,
                                      return_lse=True, backend=BACKEND)
    assert torch.equal(out.view(b, seqlen, hq, d), dense)
    assert torch.equal(lse.view(hq, b, seqlen).transpose(0, 1), dense_lse)


def run_bwd_poisoned(dout, q, k, v, out, lse, cq, ck, causal, dlse=None, seqused_q=None, seqused_k=None,
                     window=None, softcap=0.0, deterministic=False, backend=BACKEND):
    """The packed backward into NaN-poisoned gradients (an element it forgets to write fails)."""
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    lq = (cq[1:] - cq[:-1]) if seqused_q is None else seqused_q
    lk = (ck[1:] - ck[:-1]) if seqused_k is None else seqused_k
    _launch_varlen_bwd(dout, q, k, v, out, lse, dlse, cq, ck, seqused_q, seqused_k, int(lq.max()) if lq.numel() else 0,
                       int(lk.max()) if lk.numel() else 0, dq, dk, dv, q.shape[-1] ** -0.5, causal, window, softcap,
                       None, None, deterministic, ARCH[backend])
    return dq, dk, dv


def check_sequence_grads(grads, dout, q, k, v, cq, ck, causal, dlse=None, seqused_q=None, seqused_k=None,
                         window=None, softcap=0.0):
    """Each sequence's gradients with FA3's criterion against that sequence alone; rows of no sequence: dq
    unwritten (NaN), dk/dv unwritten (NaN) or, under GQA (summed in float32 over the whole tensor), 0."""
    dq, dk, dv = grads
    starts_q, starts_k = cq.tolist(), ck.tolist()
    used_q = torch.zeros(q.shape[0], dtype=torch.bool, device="cuda")
    used_k = torch.zeros(k.shape[0], dtype=torch.bool, device="cuda")
    scale = q.shape[-1] ** -0.5
    for b in range(len(starts_q) - 1):
        oq, ok = starts_q[b], starts_k[b]
        nq = starts_q[b + 1] - oq if seqused_q is None else int(seqused_q[b])
        nk = starts_k[b + 1] - ok if seqused_k is None else int(seqused_k[b])
        rq, rk = slice(oq, oq + nq), slice(ok, ok + nk)
        used_q[rq], used_k[rk] = True, True
        if nq == 0 or nk == 0:  # nothing attends: exact zeros where the sequence has rows
            for name, g in (("dq", dq[rq]), ("dk", dk[rk]), ("dv", dv[rk])):
                assert torch.equal(g, torch.zeros_like(g)), f"sequence {b} ({nq} x {nk}): {name} is not 0"
            continue
        assert_grads_match_or_control((dq[None, rq], dk[None, rk], dv[None, rk]), dout[None, rq], q[None, rq],
                                      k[None, rk], v[None, rk], scale, causal,
                                      None if dlse is None else dlse[None, :, rq], window=window, softcap=softcap)
    assert torch.isnan(dq[~used_q]).all(), "dq rows of no sequence were written"
    gqa = q.shape[1] != k.shape[1]
    for name, g in (("dk", dk[~used_k]), ("dv", dv[~used_k])):
        assert (g == 0).all() if gqa else torch.isnan(g).all(), f"{name} rows of no sequence: unexpected values"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", list(VARLEN_HEADDIMS))
@pytest.mark.parametrize("case", range(len(LENGTHS)))
def test_varlen_bwd_matches_reference(case: int, d: int, causal: bool, backend: str) -> None:
    dtype = DTYPES[(case + d) % 2]
    require_backend(backend, dtype, d, causal, mode="bwd", varlen=True)
    lq, lk = LENGTHS[case]
    lk = lq if lk is None else lk
    gqa = [1, 2, 4][case % 3]
    torch.manual_seed(case * 1000 + d + 1)
    q, k, v, cq, ck = packed(lq, lk, NHEADS_Q, NHEADS_Q // gqa, d, dtype, pad=case % 2 * 37)
    out, lse = run_poisoned(q, k, v, cq, ck, causal, backend=backend)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if case % 2 else None  # gradients through lse too
    grads = run_bwd_poisoned(dout, q, k, v, out, lse, cq, ck, causal, dlse, backend=backend)
    check_sequence_grads(grads, dout, q, k, v, cq, ck, causal, dlse)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_bwd_many_short_sequences(backend: str) -> None:
    """Thousands of sequences of 0..16 tokens (the forward's test_many_short_sequences), MQA: every gradient row
    written (no NaN left of the poison), every 97th sequence against that sequence alone."""
    require_backend(backend, torch.float16, 64, True, mode="bwd", varlen=True)
    rng = random.Random(6)
    lengths = [rng.randint(0, 16) for _ in range(3000)]
    torch.manual_seed(6)
    q, k, v, cq, ck = packed(lengths, lengths, NHEADS_Q, 1, 64, torch.float16)
    out, lse = run_poisoned(q, k, v, cq, ck, True, backend=backend)
    dout = torch.randn_like(out)
    dq, dk, dv = run_bwd_poisoned(dout, q, k, v, out, lse, cq, ck, True, backend=backend)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(g).any(), f"{name}: {int(torch.isnan(g).any(-1).any(-1).sum())} rows left unwritten"
    starts = cq.tolist()
    for b in range(0, len(lengths), 97):
        r = slice(starts[b], starts[b] + lengths[b])
        if lengths[b]:
            assert_grads_match_or_control((dq[None, r], dk[None, r], dv[None, r]), dout[None, r], q[None, r],
                                          k[None, r], v[None, r], 64 ** -0.5, True, None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["plain", "window", "softcap"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_bwd_seqused_and_variants(causal: bool, variant: str, backend: str) -> None:
    """Slots used in part, with a window or softcap: gradients of the used rows only (0 past seqused)."""
    window = ((90, 0) if causal else (90, 33)) if variant == "window" else None
    softcap = 15.0 if variant == "softcap" else 0.0
    require_backend(backend, torch.bfloat16, 128, causal, mode="bwd", window=window, softcap=softcap, varlen=True)
    torch.manual_seed(23)
    slots_q, slots_k = [300, 64, 1, 500], [400, 64, 9, 128]
    q, k, v, cq, ck = packed(slots_q, slots_k, NHEADS_Q, NHEADS_Q, 128, torch.bfloat16)
    used_q = torch.tensor([129, 0, 1, 500], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([400, 5, 0, 77], dtype=torch.int32, device="cuda")
    out, lse = run_poisoned(q, k, v, cq, ck, causal, used_q, used_k, window=window, softcap=softcap,
                            backend=backend)
    dout = torch.randn_like(out)
    grads = run_bwd_poisoned(dout, q, k, v, out, lse, cq, ck, causal, None, used_q, used_k, window=window,
                             softcap=softcap, backend=backend)
    check_sequence_grads(grads, dout, q, k, v, cq, ck, causal, None, used_q, used_k, window=window,
                         softcap=softcap)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hkv", [NHEADS_Q, 1])
def test_varlen_bwd_deterministic(hkv: int, backend: str) -> None:
    """deterministic=True: bitwise-identical gradients over repeated runs, and the right ones."""
    require_backend(backend, torch.bfloat16, 128, True, mode="bwd", varlen=True)
    torch.manual_seed(29)
    lengths = [1500, 3, 700, 129, 2000]
    q, k, v, cq, ck = packed(lengths, lengths, NHEADS_Q, hkv, 128, torch.bfloat16)
    out, lse = run_poisoned(q, k, v, cq, ck, True, backend=backend)
    dout = torch.randn_like(out)
    runs = [run_bwd_poisoned(dout, q, k, v, out, lse, cq, ck, True, deterministic=True, backend=backend)
            for _ in range(3)]
    for other in runs[1:]:
        for name, a, c in zip(("dq", "dk", "dv"), runs[0], other):
            assert torch.equal(a, c), f"{name} differs between deterministic runs"
    check_sequence_grads(runs[0], dout, q, k, v, cq, ck, True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_bwd_no_leak_between_sequences(causal: bool, backend: str) -> None:
    """Changing one sequence's inputs and upstream gradients (or filling them with NaN) leaves every other
    sequence's gradients bitwise the same (deterministic: the dQ sums in a fixed order)."""
    require_backend(backend, torch.bfloat16, 64, causal, mode="bwd", varlen=True)
    torch.manual_seed(31)
    lengths = [130, 77, 1, 300, 64]
    q, k, v, cq, ck = packed(lengths, lengths, NHEADS_Q, NHEADS_Q, 64, torch.bfloat16)
    out, lse = run_poisoned(q, k, v, cq, ck, causal, backend=backend)
    dout = torch.randn_like(out)
    base = run_bwd_poisoned(dout, q, k, v, out, lse, cq, ck, causal, deterministic=True, backend=backend)
    starts = cq.tolist()
    for victim, fill in ((1, None), (3, float("nan")), (0, float("nan"))):
        rows = slice(starts[victim], starts[victim + 1])
        xs = [x.clone() for x in (q, k, v, out, dout)]
        lse2 = lse.clone()
        for x in xs:
            x[rows] = torch.randn_like(x[rows]) if fill is None else fill
        lse2[:, rows] = torch.randn_like(lse2[:, rows]) if fill is None else fill
        grads = run_bwd_poisoned(xs[4], *xs[:4], lse2, cq, ck, causal, deterministic=True, backend=backend)
        keep = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
        keep[rows] = False
        for name, g, g0 in zip(("dq", "dk", "dv"), grads, base):
            assert torch.equal(g[keep], g0[keep]), f"sequence {victim} changed ({fill}): another's {name} changed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_autograd(backend: str) -> None:
    """flash_attn_varlen_func under autograd: q, k, v and sinks gradients through out and lse, against
    torch's autograd of the float32 reference on the same inputs (FA3's criterion's baseline is not
    needed: the reference's gradients are the yardstick for the dedicated tests above)."""
    require_backend(backend, torch.bfloat16, 64, True, mode="bwd", varlen=True)
    torch.manual_seed(37)
    lengths = [200, 1, 333]
    q, k, v, cq, ck = packed(lengths, lengths, NHEADS_Q, 2, 64, torch.bfloat16)
    sinks = torch.randn(NHEADS_Q, device="cuda")
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out, lse = flash_attn_varlen_func(*leaves[:3], cq, ck, 333, 333, causal=True, sinks=leaves[3], return_lse=True,
                                      backend=backend)
    w = torch.randn_like(lse)
    (out.float().sum() + (lse * w).sum()).backward()  # out.sum(): a stride-0 upstream gradient
    ref = [x.detach().float().requires_grad_() for x in (q, k, v)] + [sinks.clone().requires_grad_()]
    from flashhopper import attention_varlen_ref
    ro, rl = attention_varlen_ref(*ref[:3], cq, ck, None, True, sinks=ref[3], dtype=torch.float32)
    (ro.sum() + (rl * w).sum()).backward()
    for name, a, r in zip(("q", "k", "v", "sinks"), leaves, ref):
        err = ((a.grad.float() - r.grad).norm() / r.grad.norm()).item()
        assert err < 2e-2, f"d{name} relative error {err:.3e}"


def test_varlen_compile_fullgraph_backward() -> None:
    require_backend(BACKEND, torch.bfloat16, 64, False, mode="bwd", varlen=True)
    torch.manual_seed(41)
    lengths = [300, 1, 77]
    q, k, v, cq, ck = packed(lengths, lengths, NHEADS_Q, 4, 64, torch.bfloat16)

    def f(q, k, v, cq, ck):
        # deterministic: the two runs' gradients comparable bitwise
        return flash_attn_varlen_func(q, k, v, cq, ck, 300, 300, deterministic=True).float().square().sum()

    grads = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        fn(*leaves, cq, ck).backward()
        grads.append([x.grad for x in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
