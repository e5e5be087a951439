"""scripts/fuzz.py on CPU. --cpu-smoke runs every family on tiny configurations, the reference standing in
for the kernels, and passes; the harness records a failure, with its replay command, when a result is off,
an output is left unwritten or a write lands outside an output, and tells a configured-but-missing kernel
(failure) from an unconfigured one (skip); the sampling keeps to its bounds and to the kernels' alignment."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_grads_match_or_control
from test_reference_bwd import emulated_kernel

from flashhopper import validation

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fuzz", ROOT / "scripts" / "fuzz.py")
fuzz = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["fuzz"] = fuzz  # its dataclasses look their module up while being made
_spec.loader.exec_module(fuzz)  # type: ignore[union-attr]

SEED = fuzz.FIXED_SEEDS[0]  # --cpu-smoke's


def device_like_target() -> Any:
    """What device_target() makes of a full build (sm90 + sm80, bf16/fp16/e4m3, head dims 64/128/256,
    window masks) on an H100, without asking a GPU."""
    return dataclasses.replace(fuzz.smoke_target(), device=torch.device("cpu"), headdims=(64, 128, 256),
                               archs=(90, 80), lengths=fuzz.edge_lengths((64, 80, 128, 192), fuzz.MAX_SEQLEN),
                               max_seqlen=fuzz.MAX_SEQLEN, max_elements=fuzz.MAX_ELEMENTS, notes=())


def smoke_index(family: str) -> int:
    """A configuration of --cpu-smoke's seed in ``family`` with query rows and keys."""
    target = fuzz.smoke_target()
    for i in range(200):
        c = fuzz.sample(SEED, i, target, fuzz.SMOKE["budget"])
        if c.family == family and c.batch * c.nheads_q * c.seqlen_q > 0 and c.seqlen_k > 0:
            return i
    raise AssertionError(f"no {family} configuration with rows and keys among the first 200")


def run_smoke(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    path = tmp_path / "fuzz.json"
    code = fuzz.main(["--cpu-smoke", "--json", str(path), *args])
    return code, json.loads(path.read_text())


def test_cpu_smoke_runs_every_family(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = run_smoke(tmp_path)
    assert code == 0, capsys.readouterr().out
    assert doc["complete"] and doc["done"] == fuzz.SMOKE["count"] and doc["failures"] == []
    assert set(doc["families"]) == set(fuzz.FAMILIES)
    for name, family in doc["families"].items():
        assert family["run"] >= 2 and family["failed"] == 0 and family["skipped"] == {}, (name, family)
        assert family["worst_ratio"] <= 1, (name, family)
    assert "total" in capsys.readouterr().out


def scaled_output(factor: float) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An entry point returning (out, lse) whose out is ``factor`` times too large."""
    def wrap(entry: Callable[..., Any]) -> Callable[..., Any]:
        def wrong(*args: Any, **kwargs: Any) -> Any:
            out, lse = entry(*args, **kwargs)
            return out * factor, lse
        return wrong
    return wrap


def last_row_unwritten(launch: Callable[..., Any]) -> Callable[..., Any]:
    def partial(cfg: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor) -> None:
        launch(cfg, q, k, v, out, lse)
        out[:, -1] = math.nan  # what the poison leaves where the kernel writes nothing
    return partial


def writes_before_out(launch: Callable[..., Any]) -> Callable[..., Any]:
    def stray(cfg: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor) -> None:
        launch(cfg, q, k, v, out, lse)
        out.as_strided((1,), (1,), out.storage_offset() - 1).fill_(0)
    return stray


def writes_past_dk(launch: Callable[..., Any]) -> Callable[..., Any]:
    def stray(cfg: Any, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, dlse: torch.Tensor | None, grads: list[torch.Tensor]) -> None:
        launch(cfg, dout, q, k, v, out, lse, dlse, grads)
        dk = grads[1]
        last = dk.storage_offset() + sum((n - 1) * s for n, s in zip(dk.shape, dk.stride()))
        dk.as_strided((1,), (1,), last + 1).fill_(1)
    return stray


def wrong_dq(launch: Callable[..., Any]) -> Callable[..., Any]:
    def off(cfg: Any, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, dlse: torch.Tensor | None, grads: list[torch.Tensor]) -> None:
        launch(cfg, dout, q, k, v, out, lse, dlse, grads)
        grads[0].mul_(1.05)
    return off


@pytest.mark.parametrize(("family", "entry", "wrong", "message", "bounded"), [
    ("dense", "flash_attn_func", scaled_output(1.05), "out max-abs error", True),
    ("fp8", "flash_attn_fp8_func", scaled_output(1.2), "from exact attention", True),
    ("ops", "launch_fwd", last_row_unwritten, "out has NaN", False),
    ("ops", "launch_fwd", writes_before_out, "out: 1 elements outside the output were overwritten, the first -1 ",
     False),
    ("ops-window", "launch_bwd", writes_past_dk, "dk: 1 elements outside the output were overwritten", False),
    ("ops", "launch_bwd", wrong_dq, "dq max-abs error", True),
], ids=["wrong-out", "wrong-fp8-out", "unwritten-row", "write-before-out", "write-past-dk", "wrong-dq"])
def test_the_harness_fails(family: str, entry: str, wrong: Callable[..., Any], message: str, bounded: bool,
                           tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    index = smoke_index(family)
    monkeypatch.setattr(fuzz, entry, wrong(getattr(fuzz, entry)))
    code, doc = run_smoke(tmp_path, "--seed", str(SEED), "--index", str(index))
    out = capsys.readouterr().out
    assert code == 1 and doc["families"][family]["failed"] == 1, out
    (failure,) = doc["failures"]
    assert message in failure["message"], failure
    assert (failure["ratio"] is not None and failure["ratio"] > 1) if bounded else failure["ratio"] is None, failure
    replay = f"python scripts/fuzz.py --seed {SEED} --index {index} --cpu-smoke"
    assert failure["replay"] == replay and f"replay: {replay}" in out
    assert "  data_seed = " in out  # a replayed configuration is described in full


def test_gradients_judged_against_the_control() -> None:
    # With few keys, a FlashAttention-style backward's roundings (the emulation: D from the bf16 out, P and dS
    # rounded for the matmuls) can fail helpers' criterion by themselves; such gradients pass once the
    # criterion's baseline includes the emulation's error, and a wrong one still fails.
    cfg = fuzz.sample(SEED, 0, fuzz.smoke_target(), fuzz.SMOKE["budget"])
    cfg = dataclasses.replace(cfg, dtype=torch.bfloat16, headdim=64, batch=3, seqlen_q=2, seqlen_k=2, nheads_kv=8,
                              group=1, causal=True, softmax_scale=None, window=None)
    for _ in range(200):
        q, k, v = (x.to(torch.bfloat16) for x in helpers_randn(cfg))
        dout = torch.randn_like(q)
        control = emulated_kernel(dout, q, k, v, cfg.scale, True)
        try:
            fuzz.criterion(fuzz.assert_grads_match, control, dout, q, k, v, cfg.scale, True, None)
        except fuzz.CheckFailed:
            break
    else:
        raise AssertionError("no input among 200 on which the emulated backward fails the criterion")
    outcome = fuzz.judge_grads(control, dout, q, k, v, None, cfg)
    assert outcome.by_control and outcome.ratio <= 0.5, outcome
    with pytest.raises(fuzz.CheckFailed, match="against the FlashAttention-style emulation too"):
        fuzz.judge_grads((control[0], control[1] * 1.5, control[2]), dout, q, k, v, None, cfg)
    # The largest dq element a unit in the last place off (luck, with few elements) passes; six units do not.
    dq = control[0].contiguous().clone()
    at = dq.float().abs().argmax()
    ulp = torch.finfo(dq.dtype).eps * 2.0 ** math.floor(math.log2(abs(dq.view(-1)[at].item())))
    for units, passes in ((1, True), (6, False)):
        moved = dq.clone()
        moved.view(-1)[at] += units * ulp * (1 if moved.view(-1)[at] > 0 else -1)
        if passes:
            assert fuzz.judge_grads((moved, *control[1:]), dout, q, k, v, None, cfg).by_control
        else:
            with pytest.raises(fuzz.CheckFailed, match="max-abs"):
                fuzz.judge_grads((moved, *control[1:]), dout, q, k, v, None, cfg)
    nan_dv = control[2].contiguous().clone()
    nan_dv.view(-1)[-1] = math.nan
    with pytest.raises(AssertionError):
        fuzz.judge_grads((*control[:2], nan_dv), dout, q, k, v, None, cfg)
    # The GPU grid tests' form of the same judgement (helpers.assert_grads_match_or_control).
    assert_grads_match_or_control(control, dout, q, k, v, cfg.scale, True)
    with pytest.raises(AssertionError, match="against the FlashAttention-style emulation too"):
        assert_grads_match_or_control((control[0], control[1] * 1.5, control[2]), dout, q, k, v, cfg.scale, True)
    with pytest.raises(AssertionError, match="has NaN|is nan x its bound"):
        assert_grads_match_or_control((*control[:2], nan_dv), dout, q, k, v, cfg.scale, True)


def helpers_randn(cfg: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fuzz.helpers.randn_qkv(cfg.batch, cfg.seqlen_q, cfg.seqlen_k, cfg.nheads_q, cfg.nheads_kv, cfg.headdim)


@pytest.mark.parametrize(("configured", "status"), [(True, "failed"), (False, "skipped")])
def test_missing_kernel(configured: bool, status: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A kernel the build lacks: a failure when the build was configured with it, else a skip; nothing runs.
    target = device_like_target()
    cfg = next(c for c in (fuzz.sample(SEED, i, target, fuzz.DEFAULT_BUDGET) for i in range(50)) if c.family == "ops")
    monkeypatch.setattr(fuzz._ext, "kernel", lambda mode, key: None)
    monkeypatch.setattr(fuzz._ext, "configured", lambda mode, key: configured)
    monkeypatch.setattr(fuzz, "RUNNERS", {})  # reaching a runner would be a KeyError
    result, alive = fuzz.run_one(cfg, target)
    assert alive and result.status == status, result
    assert ("configured with the fwd kernel" if configured else "no fwd kernel") in result.message


def test_sampling_bounds_and_alignment() -> None:
    target = device_like_target()
    plan = fuzz.schedule(2000, fuzz.FIXED_SEEDS, 7)
    assert len(set(plan)) == len(plan) and sum(seed == 7 for seed, _ in plan) == 1000
    configs = [fuzz.sample(seed, index, target, fuzz.DEFAULT_BUDGET) for seed, index in plan]
    assert configs[:20] == [fuzz.sample(seed, index, target, fuzz.DEFAULT_BUDGET) for seed, index in plan[:20]]
    for c in configs:
        assert 0 <= c.seqlen_q <= fuzz.MAX_SEQLEN and 0 <= c.seqlen_k <= fuzz.MAX_SEQLEN, c
        assert c.batch <= fuzz.MAX_BATCH and 1 <= c.group <= fuzz.MAX_GROUP, c
        assert c.batch * c.nheads_q * max(c.seqlen_q, 1) * max(c.seqlen_k, 1) <= fuzz.DEFAULT_BUDGET, c
        assert c.batch * c.nheads_q * max(c.seqlen_q, c.seqlen_k, 1) * c.headdim <= fuzz.MAX_ELEMENTS, c
        assert not c.packed or c.seqlen_q == c.seqlen_k, c
        if c.family != "variants":
            assert (c.window is not None and c.window != (-1, -1)) == (c.family == "ops-window"), c
        assert (c.softcap > 0 or c.sinks) <= (c.family == "variants"), c
        assert c.family != "variants" or c.window is not None or c.softcap > 0 or c.sinks, c
        rows = c.batch * c.nheads_q * c.seqlen_q
        if c.family in fuzz.FP8_FAMILIES and c.seqlen_k and rows:  # enough for fp8's relative error bound
            assert rows >= 8, c  # MIN_FP8_ROWS, or what MAX_ELEMENTS leaves at 16k keys of head dim 256
    weights = {f: w for f, (_, w) in fuzz.FAMILIES.items()}
    for family, n in Counter(c.family for c in configs).items():
        assert abs(n / len(configs) - weights[family] / sum(weights.values())) < 0.01, (family, n)
    lengths = [n for c in configs for n in (c.seqlen_q, c.seqlen_k)]
    assert {0, 1, 63, 64, 65, 127, 128, 129, fuzz.MAX_SEQLEN} <= set(lengths)
    assert sum(n % 2 for n in lengths) > 0.6 * len(lengths) and sum(n >= 8192 for n in lengths) > 100
    assert max(c.batch for c in configs) > 256 and max(c.group for c in configs) > 16
    assert sum(c.packed for c in configs) > 200 and sum(c.softmax_scale is not None for c in configs) > 400
    variants = [c for c in configs if c.family == "variants"]  # each option about half the time
    for drawn in (sum(c.window is not None for c in variants), sum(c.softcap > 0 for c in variants),
                  sum(c.sinks for c in variants)):
        assert 0.35 * len(variants) < drawn < 0.8 * len(variants), drawn

    # Every placement keeps the kernels' 16-byte alignment (pointer and strides), for any element size.
    meta = torch.device("meta")
    for c in configs[:300]:
        views = list(fuzz.make_qkv(c, meta))
        for dtype in (c.dtype, torch.float8_e4m3fn):
            views += [fuzz.placed(views[i].shape, dtype, c.layouts[i], meta, 0)[0] for i in range(3)]
        shapes = [views[0].shape, views[0].shape, *(v.shape for v in views[:3])]  # dout, out, dq, dk, dv
        layouts = [c.dout_layout, *c.out_layouts[:1], *c.out_layouts[2:]]
        views += [fuzz.placed(s, c.dtype, lay, meta, 0)[0] for s, lay in zip(shapes, layouts)]
        for x in views:
            assert validation.kernel_layout_ok(x), (c, tuple(x.shape), x.stride(), x.storage_offset())
