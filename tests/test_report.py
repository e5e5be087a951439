"""flashhopper-report: the numbers in its tables, the files it writes and its no-GPU paths, rendered
from committed results (tests/data/report_h100_subset.json: a subset of the 2026-11-22 H100 run in
bench/results, with that day's measured ceilings); a one-shape sweep end to end on a GPU."""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import flashhopper
from flashhopper import _ext, dispatch
from flashhopper.report import ceilings, cli, environment, fa3, io_model, metrics, render, results, sweep
from flashhopper.report.providers import (FA3_PROVIDERS, PROVIDERS, Prepared, Provider, Unavailable, provider,
                                          provider_name, quantize_per_kv_head, with_fa3)
from flashhopper.report.sweep import QUICK, grid
from flashhopper.report.timing import make_timer

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "report_h100_subset.json"
BENCH_FILE = ROOT / "bench" / "results" / "h100_2026-11-22_fwd.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _one(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [r for r in rows if all(r[k] == v for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


def _raw_ms(**match: Any) -> float:
    return _one(json.loads(FIXTURE.read_text())["rows"], **match)["ms"]


def _table_line(text: str, title: str, seqlen: int, provider: str) -> list[str]:
    """The cells of one line of the console table under ``title``."""
    section = text.split(f"\n{title}\n", 1)[1].split("\n\n", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == str(seqlen) and cells[2] == provider:
            return cells
    raise AssertionError(f"no {provider} line at seqlen {seqlen} under {title!r}")


# --- numbers ---------------------------------------------------------------------------------

def test_tflops_percentages_and_speedup() -> None:
    rows = results.load(FIXTURE).derived()
    shape = dict(mode="fwd", dtype="bf16", headdim=128, seqlen=4096)
    ms = _raw_ms(**shape, causal=False, provider="flashhopper")
    # batch 4 x seqlen 4096 = 16384 tokens, 16 heads x 128 = 2048: two matmuls of 2*s*s*d per head.
    tf = 4 * 4 * 16 * 4096 * 4096 * 128 / (ms * 1e-3) / 1e12
    ours = _one(rows, **shape, causal=False, provider="flashhopper")
    assert ours["tflops"] == pytest.approx(tf)
    assert ours["pct_gemm_ceiling"] == pytest.approx(100 * tf / 801.0)
    assert ours["pct_datasheet_peak"] == pytest.approx(100 * tf / 989.4)
    # The best peer is the fastest one on the same shape: cuDNN here; same FLOPs, so a ratio of times.
    peer_ms = {p: _raw_ms(**shape, causal=False, provider=p) for p in ("sdpa-cudnn", "sdpa-fa2", "sdpa-memeff")}
    assert min(peer_ms, key=peer_ms.__getitem__) == ours["best_peer"] == "sdpa-cudnn"
    assert ours["speedup_vs_best_peer"] == pytest.approx(peer_ms["sdpa-cudnn"] / ms)

    causal_ms = _raw_ms(**shape, causal=True, provider="flashhopper")
    causal = _one(rows, **shape, causal=True, provider="flashhopper")
    assert causal["tflops"] == pytest.approx(tf * ms / causal_ms / 2)  # causal counts half the FLOPs

    short = _one(rows, mode="fwd", headdim=64, causal=True, seqlen=512, provider="flashhopper")
    assert short["speedup_vs_best_peer"] < 1  # cuDNN wins at 512 causal in that run: shown, not hidden

    cudnn = _one(rows, **shape, causal=False, provider="sdpa-cudnn")
    assert cudnn["pct_gemm_ceiling"] is not None and cudnn["speedup_vs_best_peer"] is None
    assert cudnn["io_ours_bytes"] is None
    skipped = _one(rows, **shape, causal=False, provider="flashhopper-sm80")
    assert skipped["tflops"] is None and "sm80" in skipped["skipped"]


def test_fp8_rows_are_measured_against_the_fp8_peak() -> None:
    # An fp8 kernel on bf16 inputs: the row's dtype is the inputs' (bf16), its percentages the fp8 ones.
    shape = dict(mode="fwd", dtype="bf16", headdim=256, causal=False, seqlen=4096, batch=4, nheads=8)
    raw = [{**shape, "provider": p, "kernel_dtype": kd, "ms": 0.25, "block_m": 128, "block_n": 128}
           for p, kd in (("flashhopper", None), ("flashhopper-fp8", "fp8"))]
    ceilings = {"gemm": {"bf16": {"tflops": 800.0}, "fp8": {"tflops": 1360.0}}}
    rows = metrics.derive(raw, ceilings, {"tflops": {"bf16": 989.4, "fp8": 1978.9}})
    bf16, fp8 = _one(rows, provider="flashhopper"), _one(rows, provider="flashhopper-fp8")
    assert bf16["tflops"] == pytest.approx(fp8["tflops"])  # same FLOPs, same time
    assert bf16["pct_gemm_ceiling"] == pytest.approx(100 * bf16["tflops"] / 800.0)
    assert fp8["pct_gemm_ceiling"] == pytest.approx(100 * fp8["tflops"] / 1360.0)
    assert fp8["pct_datasheet_peak"] == pytest.approx(100 * fp8["tflops"] / 1978.9)
    # IO: the fp8 kernel reads e4m3 Q, K, V (1 byte) and writes bf16 O (2 bytes); bf16 moves 2 for each.
    b, s, h, d = 4, 4096, 8, 256
    keys = io_model.keys_streamed(s, s, 128, 128, False)
    assert bf16["io_ours_bytes"] == b * h * (s * d * 4 + 2 * d * keys * 2)
    assert fp8["io_ours_bytes"] == b * h * (s * d * 3 + 2 * d * keys * 1)
    assert fp8["io_standard_bytes"] == bf16["io_standard_bytes"]


def test_console_table_shows_those_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    report = results.load(FIXTURE)
    ours = _one(report.derived(), mode="fwd", headdim=128, causal=False, seqlen=4096, provider="flashhopper")
    text = render.console(report)
    cells = _table_line(text, "fwd bf16 headdim 128 non-causal", 4096, "flashhopper")
    assert cells[1] == "4 x 16"
    assert cells[4] == f"{ours['tflops']:.0f}"
    assert cells[5] == f"{ours['pct_gemm_ceiling']:.1f}%"
    assert cells[6] == f"{ours['pct_datasheet_peak']:.1f}%"
    assert cells[7] == f"{ours['speedup_vs_best_peer']:.2f}x sdpa-cudnn"
    assert cells[8] == f"{ours['io_standard_bytes'] / 1e9:.2f} GB"
    assert "bf16 GEMM 801 TFLOPS" in text and "copy 3.02 TB/s" in text
    assert "NVIDIA H100 Tensor Core GPU datasheet" in text
    # The backward has peers only; our missing backward is listed with its reason.
    assert _table_line(text, "bwd bf16 headdim 128 non-causal", 4096, "sdpa-cudnn")
    assert "- flashhopper (bwd bf16): flashhopper has no backward yet" in text


def test_io_model_by_hand() -> None:
    # One (batch, head), seqlen 256, head dim 64, bf16 (2 bytes), 128 x 128 tiles.
    # Standard: Q, K, V, O (4 * 256 * 64) + S written, read, P written, read (4 * 256^2).
    assert io_model.standard_bytes(1, 1, 256, 256, 64, 2) == (4 * 256 * 64 + 4 * 256 * 256) * 2 == 655360
    # Ours: Q + O once (2 * 256 * 64), K + V once per query tile (2 tiles * 2 * 256 * 64).
    assert io_model.flash_fwd_bytes(1, 1, 256, 256, 64, 2, 128, 128, False) == (2 + 4) * 256 * 64 * 2 == 196608
    # Causal: tile 0 sees keys 0..127 (one block), tile 1 all 256.
    assert io_model.flash_fwd_bytes(1, 1, 256, 256, 64, 2, 128, 128, True) == (2 * 256 + 2 * 384) * 64 * 2
    # Whole key blocks: 128 x 80 tiles, 200 keys: tile 0 sees 128 keys -> 2 blocks (160), tile 1 all 200.
    assert io_model.keys_streamed(200, 200, 128, 80, True) == 160 + 200
    assert io_model.keys_streamed(200, 200, 128, 80, False) == 2 * 200
    # Bottom-right alignment: more keys than queries shifts the diagonal right, fewer shifts it left.
    assert io_model.keys_streamed(128, 256, 128, 128, True) == 256
    assert io_model.keys_streamed(256, 128, 128, 128, True) == 0 + 128
    assert io_model.tbps(3e9, 1.0) == pytest.approx(3.0)


def test_io_columns_of_a_row() -> None:
    row = _one(results.load(FIXTURE).derived(), mode="fwd", headdim=128, causal=False, seqlen=4096,
               provider="flashhopper")
    b, h, s, d = 4, 16, 4096, 128
    assert row["io_standard_bytes"] == b * h * (4 * s * d + 4 * s * s) * 2
    assert row["io_ours_bytes"] == b * h * (2 * s * d + 2 * s * d * (s // 128)) * 2  # block_m = 128
    assert row["io_ours_tbps"] == pytest.approx(row["io_ours_bytes"] / (row["ms"] * 1e-3) / 1e12)


def test_datasheet_by_device_name() -> None:
    assert ceilings.datasheet_for("NVIDIA H100 80GB HBM3")["name"] == "H100 SXM5"
    assert ceilings.datasheet_for("NVIDIA H100 PCIe")["tflops"]["bf16"] == 756.5
    assert ceilings.datasheet_for("NVIDIA H200")["hbm_tbps"] == 4.8
    assert ceilings.datasheet_for("NVIDIA A100-SXM4-80GB")["tflops"]["fp8"] is None
    assert ceilings.datasheet_for("NVIDIA GeForce RTX 4090") is None


def test_unknown_device_and_failed_ceiling_show_na() -> None:
    report = results.load(FIXTURE)
    report.datasheet = None
    report.ceilings = {"gemm": {"bf16": {"how": "torch.matmul", "error": "RuntimeError: no"}}, "copy": {}}
    text = render.console(report)
    cells = _table_line(text, "fwd bf16 headdim 128 non-causal", 4096, "flashhopper")
    assert cells[5] == cells[6] == "n/a"
    assert "bf16 GEMM failed (RuntimeError: no)" in text and "no entry for 'NVIDIA H100 80GB HBM3'" in text


def test_a_ceiling_that_cannot_run_is_recorded_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def timer(fn: Any) -> float:
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED\nmore detail")

    monkeypatch.setattr(ceilings, "_gemm", lambda dtype, n: ("fp8 GEMM", lambda: None))
    got = ceilings.gemm_ceiling("fp8", timer)
    assert got == {"how": "fp8 GEMM", "error": "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"}


# --- files -------------------------------------------------------------------------------------

def test_writes_json_csv_and_pngs(tmp_path: Path) -> None:
    report = results.load(FIXTURE)
    written = render.write_all(report, tmp_path / "out")
    names = {p.name for p in written}
    assert names == {"report.json", "report.csv", "tflops_fwd_bf16.png", "tflops_bwd_bf16.png"}
    for p in written:
        if p.suffix == ".png":
            data = p.read_bytes()
            assert len(data) > 10_000 and data.startswith(PNG_MAGIC)
    ours = _one(report.derived(), mode="fwd", headdim=128, causal=False, seqlen=4096, provider="flashhopper")
    with (tmp_path / "out" / "report.csv").open() as f:
        line = _one(list(csv.DictReader(f)), mode="fwd", headdim="128", causal="False", seqlen="4096",
                    provider="flashhopper")
    assert float(line["tflops"]) == pytest.approx(ours["tflops"])
    assert float(line["speedup_vs_best_peer"]) == pytest.approx(ours["speedup_vs_best_peer"])
    # The JSON is a report file again: it loads and derives the same numbers.
    again = results.load(tmp_path / "out" / "report.json")
    assert again.ceilings == report.ceilings and again.derived() == report.derived()


def test_from_a_bench_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--from", str(BENCH_FILE), "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"rendering {BENCH_FILE} (NVIDIA H100 80GB HBM3, 2026-11-22")
    assert "Ceilings: not measured in this file" in text
    cells = _table_line(text, "fwd bf16 headdim 128 non-causal", 16384, "flashhopper")
    raw = _one(json.loads(BENCH_FILE.read_text())["results"], mode="fwd", headdim=128, causal=False,
               seqlen=16384, provider="flashhopper")
    assert cells[4] == f"{raw['tflops']:.0f}"  # the file's own TFLOPS, same formula
    assert cells[5] == "n/a" and cells[6] == f"{100 * raw['tflops'] / 989.4:.1f}%"
    assert cells[9] == "n/a"  # no tile sizes in a bench file: our IO is not known
    assert (tmp_path / "tflops_fwd_bf16.png").read_bytes().startswith(PNG_MAGIC)
    assert json.loads((tmp_path / "report.json").read_text())["ceilings"] is None


def _date(path: Path) -> dt.datetime:
    return dt.datetime.fromisoformat(json.loads(path.read_text())["environment"]["date"])


def test_newest_goes_by_the_date_inside(tmp_path: Path) -> None:
    doc = json.loads(FIXTURE.read_text())
    for name, date in (("a.json", "2027-01-02T00:00:00+00:00"), ("z.json", "2026-01-01T00:00:00+00:00")):
        doc["environment"]["date"] = date
        (tmp_path / name).write_text(json.dumps(doc))
    (tmp_path / "zz.json").write_text('{"not": "a result"}')
    shutil.copy(BENCH_FILE, tmp_path / "zzz.json")
    assert results.newest(tmp_path) == tmp_path / "a.json"
    # A newer bench file (a few providers) does not win over a report; one of bench_quant.py (rows
    # without a mode) is no attention result at all.
    bench = json.loads(BENCH_FILE.read_text())
    bench["environment"]["date"] = "2028-01-01T00:00:00+00:00"
    (tmp_path / "b.json").write_text(json.dumps(bench))
    quant = {"environment": {"date": "2029-01-01T00:00:00+00:00", "device": "x"}, "args": {},
             "results": [{"headdim": 128, "ms": 0.1}]}
    (tmp_path / "q.json").write_text(json.dumps(quant))
    with pytest.raises(ValueError, match="not of attention"):
        results.load(tmp_path / "q.json")
    assert results.newest(tmp_path) == tmp_path / "a.json"
    (tmp_path / "a.json").unlink()
    (tmp_path / "z.json").unlink()
    assert results.newest(tmp_path) == tmp_path / "b.json"


def test_timer_flush_choices() -> None:
    """The timer names its L2 flush; an unknown one is refused before anything runs."""
    assert "reads" in make_timer(1, 2, "read")[0]
    assert "read" not in make_timer(1, 2, "write")[0]
    with pytest.raises(ValueError, match="flush_by"):
        make_timer(1, 2, "zero")


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures instead of rendering when a GPU is present")
def test_without_gpu_renders_the_newest_shipped_result(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # an installed package finds bench/results through the source tree here
    reports = [p for p in (ROOT / "bench" / "results").glob("*.json")
               if json.loads(p.read_text()).get("format") == results.FORMAT]
    expected = max(reports, key=_date)
    assert cli.main(["--out", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("no CUDA GPU found: rendering ") and first.split()[5].endswith(str(expected.name))
    assert "NVIDIA H100" in first
    assert (tmp_path / "report.json").exists() and list(tmp_path.glob("*.png"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures instead of rendering when a GPU is present")
def test_without_gpu_and_nothing_to_render(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--results-dir", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "no CUDA GPU found" in capsys.readouterr().err


# --- sweep and providers -------------------------------------------------------------------------

def test_quick_sweep_shapes() -> None:
    shapes = grid(QUICK.plan, QUICK.modes, ["bf16"], [False, True], tokens=16384, width=2048)
    assert len(shapes) == 10 and {s.mode for s in shapes} == {"fwd"}
    s = next(s for s in shapes if s.headdim == 128 and s.seqlen == 1024)
    assert (s.batch, s.nheads) == (16, 16)  # the FA3 paper's 16k tokens and width 2048
    assert sorted({s.seqlen for s in shapes if s.headdim == 128}) == [1024, 4096, 16384]


def test_sweep_rounds_interleave_providers_and_take_the_median(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    fake = {name: Provider(name, lambda mode, q, k, v, causal, name=name: Prepared(lambda: calls.append(name), {}))
            for name in ("a", "b", "c")}
    monkeypatch.setattr(sweep, "provider", fake.__getitem__)
    monkeypatch.setattr(sweep, "inputs", lambda shape: (torch.zeros(1),) * 3)
    times = iter([3.0, 10.0, 5.0, 1.0, 30.0, 6.0, 2.0, 20.0, 4.0])  # a, b, c, a, b, c, a, b, c

    def timer(fn: Any) -> float:
        fn()
        return next(times)

    shape = grid({64: (512,)}, ["fwd"], ["bf16"], [False], tokens=512, width=128)
    monkeypatch.setattr(sweep.torch.cuda, "empty_cache", lambda: None)
    rows = sweep.run_sweep(shape, ["a", "b", "c"], timer, rounds=3)
    assert calls == ["a", "b", "c"] * 3  # prepared once each (one run), then timed in turn per round
    assert [r["ms"] for r in rows] == [2.0, 20.0, 5.0] and rows[0]["ms_rounds"] == [3.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="rounds"):
        sweep.run_sweep(shape, ["a"], timer, rounds=0)



def test_cli_rounds_reach_the_sweep_and_the_report(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # Same-run comparisons are medians of interleaved rounds (issue #20): 3 unless --rounds says otherwise.
    assert cli.parse_args([]).rounds == 3 and cli.parse_args(["--rounds", "5"]).rounds == 5
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            cli.parse_args(["--rounds", bad])
        assert "--rounds: must be" in capsys.readouterr().err
    # measure() without a GPU: the environment, ceilings and sweep are stand-ins; the rounds are real.
    seen: list[int] = []

    def fake_sweep(shapes: Any, providers: Any, timer: Any, progress: Any = None, rounds: int = 1) -> list[Any]:
        seen.append(rounds)
        return []

    monkeypatch.setattr(cli, "environment", lambda timer, root: {"device": "NVIDIA H100 80GB HBM3", "timer": timer})
    monkeypatch.setattr(cli, "make_timer", lambda warmup_ms, rep_ms: ("fake timer", lambda fn: 1.0))
    monkeypatch.setattr(cli.ceilings, "measure", lambda timer, dtypes: None)
    monkeypatch.setattr(cli, "run_sweep", fake_sweep)
    for argv, rounds in (([], 3), (["--rounds", "5"], 5)):
        report = cli.measure(cli.parse_args(["--hdims", "128", "--seqlens", "1024", *argv]))
        assert seen[-1] == rounds and report.config["rounds"] == rounds
        assert report.environment["timer"] == f"fake timer, median of {rounds} interleaved rounds"
        assert f"fake timer, median of {rounds} interleaved rounds" in render.header(report)


def test_provider_names() -> None:
    assert provider("flashhopper") is PROVIDERS["flashhopper"] and provider("fa3") is PROVIDERS["fa3"]
    variant = provider("flashhopper@no-pingpong")
    assert variant.name == "flashhopper@no-pingpong" and metrics.is_ours(variant.name)
    assert not metrics.is_ours("fa3") and not metrics.is_ours("fa3-fp8")
    for bad in ("flashhopper@", "flashhopper@No_PingPong", "flashhopper@-x", "fa4", "flashhopper-sm100"):
        with pytest.raises(ValueError, match="provider must be one of .*flashhopper@<variant>"):
            provider(bad)
        with pytest.raises(argparse.ArgumentTypeError):
            provider_name(bad)
    assert provider_name("flashhopper@fp8-n224") == "flashhopper@fp8-n224"
    args = cli.parse_args(["--providers", "flashhopper", "flashhopper@no-pingpong", "fa3", "sdpa-cudnn"])
    assert args.providers == ["flashhopper", "flashhopper@no-pingpong", "fa3", "sdpa-cudnn"]
    with pytest.raises(SystemExit):
        cli.parse_args(["--providers", "flashhopper@"])


def test_a_variant_is_skipped_where_the_build_lacks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 8, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(Unavailable, match="CUDA tensors"):
        provider("flashhopper@no-pingpong").prepare("fwd", q, q, q, True)
    # On a Hopper GPU: the lookup by KernelKey, variant included, names what to rebuild with.
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_ext, "kernel", lambda mode, key: None)
    with pytest.raises(Unavailable, match="no sm90 forward kernel for bfloat16 headdim 128 causal variant "
                                          "no-pingpong; rebuild with .*FLASHHOPPER_VARIANTS=no-pingpong"):
        provider("flashhopper@no-pingpong").prepare("fwd", q, q, q, True)


def test_ours_look_up_the_build_by_kernel_key(monkeypatch: pytest.MonkeyPatch) -> None:
    looked_up: list[tuple[str, Any]] = []
    fwd_key = dispatch.kernel_key("sm90", torch.bfloat16, 128, True)
    table = {("fwd", fwd_key): _ext.Entry(0, 128, 128)}

    def kernel(mode: str, key: Any) -> Any:
        looked_up.append((mode, key))
        return table.get((mode, key))

    q = torch.randn(1, 8, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(Unavailable, match="needs CUDA tensors"):
        PROVIDERS["flashhopper-sm90"].prepare("fwd", q, q, q, False)  # dispatch refuses CPU tensors first
    monkeypatch.setattr(_ext, "kernel", kernel)
    monkeypatch.setattr(dispatch, "select_backend", lambda *args, **kwargs: "sm90")
    # The backward is looked up under the same key (mode bwd) and skipped, saying what to rebuild with.
    with pytest.raises(Unavailable, match="no sm90 backward kernel for bfloat16 headdim 128 causal; rebuild"):
        PROVIDERS["flashhopper"].prepare("bwd", q, q, q, True)
    assert looked_up == [("bwd", fwd_key)]
    # The forward is found; the run then goes through flash_attn_func, which refuses CPU tensors here.
    with pytest.raises(Unavailable, match="needs CUDA tensors"):
        PROVIDERS["flashhopper"].prepare("fwd", q, q, q, True)
    assert looked_up[-1] == ("fwd", fwd_key)
    with pytest.raises(Unavailable, match="the fp8 kernels need CUDA tensors"):
        PROVIDERS["flashhopper-fp8"].prepare("fwd", q, q, q, False)


@pytest.fixture
def no_fa3(monkeypatch: pytest.MonkeyPatch) -> None:
    """FA3 not configured, whatever this machine's environment says; nothing of it imported."""
    monkeypatch.delenv(fa3.ENV, raising=False)
    monkeypatch.setattr(fa3, "_option", None)
    monkeypatch.setattr(fa3, "_loaded", {})
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "flash_attn_interface", raising=False)


@pytest.mark.usefixtures("no_fa3")
def test_fa3_missing_is_a_skip_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 8, 1, 128, dtype=torch.bfloat16)
    for name in FA3_PROVIDERS:
        with pytest.raises(Unavailable, match="FA3 is not configured: pass --fa3-path or set FLASHHOPPER_FA3_PATH"):
            PROVIDERS[name].prepare("fwd", q, q, q, False)
    assert with_fa3(["flashhopper"]) == ["flashhopper"]  # the default provider lists leave it out
    monkeypatch.setenv(fa3.ENV, str(tmp_path))
    assert with_fa3(["flashhopper", "fa3"]) == ["flashhopper", "fa3", "fa3-fp8"]
    with pytest.raises(Unavailable, match=f"{tmp_path} holds no FA3 build"):
        PROVIDERS["fa3"].prepare("bwd", q, q, q, True)
    # A build whose import fails (here: its extension is missing): the error, and nothing left behind.
    broken = tmp_path / "broken"
    (broken / "flash_attn_3").mkdir(parents=True)
    (broken / "flash_attn_interface.py").write_text("import flash_attn_3._C\n")
    monkeypatch.setenv(fa3.ENV, str(broken))
    path_before = list(sys.path)
    with pytest.raises(Unavailable, match="importing FA3 from .* failed: ModuleNotFoundError: No module named "
                                          "'flash_attn_3._C'"):
        PROVIDERS["fa3"].prepare("fwd", q, q, q, False)
    assert sys.path == path_before and "flash_attn_interface" not in sys.modules
    # --fa3-path wins over the environment.
    assert cli.main(["--fa3-path", str(tmp_path / "elsewhere"), "--from", str(BENCH_FILE),
                     "--out", str(tmp_path / "out")]) == 0
    assert fa3.path() == tmp_path / "elsewhere"
    with pytest.raises(Unavailable, match="elsewhere holds no FA3 build"):
        PROVIDERS["fa3-fp8"].prepare("fwd", q, q, q, False)


@pytest.mark.usefixtures("no_fa3")
def test_fa3_is_imported_only_when_asked_and_needs_a_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in with FA3's interface (never FA3 itself: the package and its tests do not import it).
    (tmp_path / "flash_attn_3").mkdir()
    (tmp_path / "flash_attn_interface.py").write_text("def flash_attn_func(q, k, v, causal=False):\n    return q\n")
    fa3.set_path(tmp_path)
    assert "flash_attn_interface" not in sys.modules  # configuring it imports nothing
    q = torch.randn(1, 8, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(Unavailable, match="q is on cpu; FA3's kernels need CUDA tensors"):
        PROVIDERS["fa3"].prepare("fwd", q, q, q, False)
    assert fa3.load() is sys.modules["flash_attn_interface"]
    with pytest.raises(Unavailable, match="FA3's fp8 is forward-only"):
        PROVIDERS["fa3-fp8"].prepare("bwd", q, q, q, False)


def test_fa3_counts_as_a_peer_in_its_own_precision() -> None:
    shape = dict(mode="fwd", dtype="bf16", headdim=128, causal=False, seqlen=4096, batch=4, nheads=16)
    raw = [{**shape, "provider": p, "kernel_dtype": kd, "ms": ms, "block_m": None, "block_n": None}
           for p, kd, ms in (("flashhopper", None, 1.0), ("sdpa-cudnn", None, 1.2), ("fa3", None, 0.9),
                             ("flashhopper-fp8", "fp8", 0.6), ("fa3-fp8", "fp8", 0.5))]
    rows = metrics.derive(raw, None, None)
    ours, ours8 = _one(rows, provider="flashhopper"), _one(rows, provider="flashhopper-fp8")
    assert ours["best_peer"] == "fa3" and ours["speedup_vs_best_peer"] == pytest.approx(0.9)
    assert ours8["best_peer"] == "fa3-fp8" and ours8["speedup_vs_best_peer"] == pytest.approx(0.5 / 0.6)
    assert _one(rows, provider="fa3")["speedup_vs_best_peer"] is None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)


@pytest.mark.parametrize("fa3_wrong", [False, True])
def test_a_peer_is_timed_only_if_its_output_passes_the_check(monkeypatch: pytest.MonkeyPatch, fa3_wrong: bool) -> None:
    # A misconfigured FA3 (e.g. descales in the wrong layout) must not be timed and stand as the best peer.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 128, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    ref = _sdpa(q, k, v)
    noisy = (ref.float() * (1 + 0.04 * torch.randn_like(ref.float()))).to(ref.dtype)  # fp8-like: ~4e-2
    outputs = {  # provider -> (its forward's output, kernel_dtype, ms); fa3 the fastest, were it timed
        "flashhopper": (ref, None, 1.0), "sdpa-cudnn": (ref, None, 2.0), "fa3": (v if fa3_wrong else ref, None, 0.5),
        "flashhopper-fp8": (noisy, "fp8", 0.8), "fa3-fp8": (noisy, "fp8", 0.4),
    }
    called: list[str] = []

    def fake(name: str) -> Provider:
        out, kernel_dtype, _ = outputs[name]

        def prepare(mode: str, *args: Any) -> Prepared:
            return Prepared(lambda: called.append(name) or out, {"kernel_dtype": kernel_dtype})

        return Provider(name, prepare, rel_err_tolerance=PROVIDERS[name].rel_err_tolerance)  # the real tolerances

    fakes = {name: fake(name) for name in outputs}
    monkeypatch.setattr(sweep, "provider", fakes.__getitem__)
    monkeypatch.setattr(sweep, "inputs", lambda shape: (q, k, v))
    monkeypatch.setattr(sweep.torch.cuda, "empty_cache", lambda: None)

    def timer(fn: Any) -> float:
        fn()
        return outputs[called[-1]][2]

    shapes = grid({64: (128,)}, ["fwd"], ["bf16"], [False], tokens=256, width=128)
    raw = sweep.run_sweep(shapes, list(outputs), timer)
    rows = {r["provider"]: r for r in metrics.derive(raw, None, None)}
    assert rows["sdpa-cudnn"]["rel_err_vs_sdpa"] is None  # the reference is not checked against itself
    # fp8 peers are held to fp8's tolerance, not bf16's: timed, and the fp8 kernel's best peer.
    assert 1e-2 < rows["fa3-fp8"]["rel_err_vs_sdpa"] < 8e-2 and rows["fa3-fp8"]["ms"] == 0.4
    assert rows["flashhopper-fp8"]["best_peer"] == "fa3-fp8"
    ours, peer = rows["flashhopper"], rows["fa3"]
    if not fa3_wrong:
        assert peer["rel_err_vs_sdpa"] < 1e-2 and peer["ms"] == 0.5 and peer["skipped"] is None
        assert ours["best_peer"] == "fa3" and ours["speedup_vs_best_peer"] == pytest.approx(0.5)
        return
    assert peer["rel_err_vs_sdpa"] > 1 and peer["ms"] is None and peer["tflops"] is None
    assert peer["skipped"] == f"output check failed: rel err {peer['rel_err_vs_sdpa']:.2e} vs SDPA > tol 1e-02"
    assert called.count("fa3") == 1  # the check's run, never the timer's
    assert ours["best_peer"] == "sdpa-cudnn" and ours["speedup_vs_best_peer"] == pytest.approx(2.0)
    assert sweep.skip_reasons(raw)["fa3 (fwd)"].startswith("output check failed")


def test_fa3_fp8_scales_per_batch_and_kv_head() -> None:
    torch.manual_seed(0)
    spread = torch.tensor([[1.0, 3.0, 0.5, 8.0], [2.0, 0.25, 4.0, 1.0]]).view(2, 1, 4, 1)  # each (b, h) its own range
    x = (torch.randn(2, 96, 4, 64) * spread).to(torch.bfloat16)
    for nheads_kv in (4, 2):  # MHA, and GQA: the query heads of a kv head share its scale
        data, descale = quantize_per_kv_head(x, nheads_kv)
        assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
        assert descale.dtype == torch.float32 and descale.shape == (2, nheads_kv)
        amax = x.float().abs().view(2, 96, nheads_kv, -1).amax(dim=(1, 3))
        torch.testing.assert_close(descale, amax / 448, rtol=1e-7, atol=0)
        group = data.float().abs().view(2, 96, nheads_kv, -1).amax(dim=(1, 3))
        assert torch.equal(group, torch.full_like(group, 448.0))  # each slice uses e4m3's whole range
        deq = data.float() * descale.repeat_interleave(4 // nheads_kv, dim=1)[:, None, :, None]
        err = (deq - x.float()).abs().view(2, 96, nheads_kv, -1).amax(dim=(1, 3))
        assert (err <= amax / 16).all()  # e4m3 rounding, relative to each slice's own amax
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_per_kv_head(x, 3)


@pytest.mark.usefixtures("no_fa3")
def test_fa3_fp8_gets_its_descales_per_batch_and_kv_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in for FA3's fp8 forward that dequantizes with the descales it is given, (batch, nheads_kv) each.
    (tmp_path / "flash_attn_3").mkdir()
    (tmp_path / "flash_attn_interface.py").write_text(
        "import torch\n"
        "def flash_attn_func(q, k, v, causal=False, q_descale=None, k_descale=None, v_descale=None):\n"
        "    b, hkv = k.shape[0], k.shape[2]\n"
        "    assert all(d.shape == (b, hkv) and d.dtype == torch.float32 for d in (q_descale, k_descale, v_descale))\n"
        "    q, k, v = (x.float() * d[:, None, :, None] for x, d in ((q, q_descale), (k, k_descale), (v, v_descale)))\n"
        "    out = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),\n"
        "                                                           is_causal=causal)\n"
        "    return out.transpose(1, 2).to(torch.bfloat16)\n")
    fa3.set_path(tmp_path)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    torch.manual_seed(0)
    q, k = (torch.randn(2, 128, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    # V of a different range per (batch, head): descales read in another layout would scale the wrong slices.
    v = (torch.randn(2, 128, 2, 64) * torch.tensor([[1.0, 16.0], [4.0, 0.5]]).view(2, 1, 2, 1)).to(torch.bfloat16)
    prepared = PROVIDERS["fa3-fp8"].prepare("fwd", q, k, v, True)
    assert prepared.meta == {"kernel_dtype": "fp8"}
    err = sweep.check_against_sdpa(prepared.fn, q, k, v, True)
    assert err is not None and err < PROVIDERS["fa3-fp8"].rel_err_tolerance


def test_environment_names_the_fa3_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fa3, "_option", tmp_path)
    monkeypatch.setattr(environment.torch.cuda, "current_device", lambda: 0)
    props = argparse.Namespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(environment.torch.cuda, "get_device_properties", lambda index: props)
    assert environment.environment("timer", ROOT)["fa3_path"] == str(tmp_path)


# --- on the GPU -----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_one_shape_end_to_end(tmp_path: Path) -> None:
    args = ["--hdims", "128", "--seqlens", "1024", "--causal", "off", "--providers", "flashhopper-sm90",
            "sdpa-cudnn", "--warmup-ms", "5", "--rep-ms", "10", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["format"] == results.FORMAT and doc["environment"]["device"] == torch.cuda.get_device_name()
    assert doc["ceilings"]["gemm"]["bf16"]["tflops"] > 0 and doc["ceilings"]["copy"]["tbps"] > 0
    assert {r["provider"] for r in doc["rows"]} == {"flashhopper-sm90", "sdpa-cudnn"}
    ours = _one(doc["rows"], provider="flashhopper-sm90")
    if ours["skipped"] is None:  # built: measured, checked against SDPA, IO from its real tile
        assert ours["tflops"] > 0 and ours["rel_err_vs_sdpa"] < 1e-2 and ours["io_ours_bytes"] > 0
    assert (tmp_path / "tflops_fwd_bf16.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.gpu
def test_a_variant_is_timed_beside_production() -> None:
    info = flashhopper.build_info()
    if "no-pingpong" not in info.get("variants", []) or "bf16" not in info["dtypes"] or 128 not in info["headdims"]:
        pytest.skip("this build was not configured with FLASHHOPPER_VARIANTS=no-pingpong (bf16, head dim 128)")
    shapes = grid({128: (1024,)}, ["fwd", "bwd"], ["bf16"], [False, True], tokens=2048, width=512)
    rows = sweep.run_sweep(shapes, ["flashhopper", "flashhopper@no-pingpong"], make_timer(2, 5)[1], rounds=2)
    for r in rows:
        if r["provider"] == "flashhopper@no-pingpong" and r["mode"] == "bwd":  # a forward-only variant
            assert "no sm90 backward kernel" in r["skipped"] and "variant no-pingpong" in r["skipped"]
            continue
        assert r.get("skipped") is None and r["ms"] > 0 and len(r["ms_rounds"]) == 2, r
        if r["mode"] == "fwd":  # NaN-poisoned outputs: an unwritten element would show here
            assert r["rel_err_vs_sdpa"] < 1e-2, r
    variant = _one(rows, provider="flashhopper@no-pingpong", mode="fwd", causal=True)
    ours = _one(rows, provider="flashhopper", mode="fwd", causal=True)
    assert (variant["block_m"], variant["block_n"]) == (ours["block_m"], ours["block_n"])  # same tiles
