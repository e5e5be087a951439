"""bench/compare_builds.py: before/after ratios of two builds' bench_attention.py results, on synthetic
files whose numbers are known."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("compare_builds", ROOT / "bench" / "compare_builds.py")
compare_builds = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(compare_builds)  # type: ignore[union-attr]


def _row(mode: str, provider: str, seqlen: int, causal: bool, ms: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {"mode": mode, "dtype": "bf16", "headdim": 128, "causal": causal, "seqlen": seqlen,
                           "batch": 16384 // seqlen, "nheads": 16, "provider": provider}
    if ms is None:
        row["skipped"] = "this build has no bwd kernel"
    else:
        row.update(ms=ms, tflops=1.0)
    return row


def _write(path: Path, rows: list[dict[str, Any]], label: str | None = None) -> Path:
    doc: dict[str, Any] = {"environment": {"device": "NVIDIA H100 80GB HBM3"}, "args": {}, "results": rows}
    if label is not None:
        doc["label"] = label
    path.write_text(json.dumps(doc))
    return path


def _grid(fwd: tuple[float, float], bwd: tuple[float, float], fp8: tuple[float, float]) -> list[dict[str, Any]]:
    """Two seqlens per (mode, provider), with these ms."""
    return [_row("fwd", "flashhopper", 1024, False, fwd[0]), _row("fwd", "flashhopper", 4096, True, fwd[1]),
            _row("bwd", "flashhopper", 1024, False, bwd[0]), _row("bwd", "flashhopper", 4096, True, bwd[1]),
            _row("fwd", "flashhopper-fp8", 1024, False, fp8[0]), _row("fwd", "flashhopper-fp8", 4096, True, fp8[1]),
            _row("bwd", "flashhopper-fp8", 1024, False, None)]


def _geomean_line(text: str, mode: str, provider: str) -> list[str]:
    for line in text.split("Geometric mean", 1)[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == [mode, provider]:
            return cells
    raise AssertionError(f"no geometric mean line for {mode} {provider}")


def test_ratios_medians_and_geometric_means(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Base: two alternating runs; the cell's time is their median (2 files: the mean of the two).
    base = [_write(tmp_path / "b1.json", _grid((1.0, 2.0), (3.0, 4.0), (0.5, 1.0)), "base"),
            _write(tmp_path / "b2.json", _grid((1.2, 2.0), (3.0, 4.4), (0.5, 1.0)))]  # unlabelled: older harness
    new = [_write(tmp_path / "n1.json", _grid((1.1, 2.0), (3.03, 4.2), (0.6, 1.0)), "new")]
    assert compare_builds.main(["--base", *map(str, base), "--new", *map(str, new)]) == 1
    text = capsys.readouterr().out
    # fwd: base medians 1.1 and 2.0, new 1.1 and 2.0 -> ratios 1, 1.
    fwd = _geomean_line(text, "fwd", "flashhopper")
    assert fwd[2] == "2" and float(fwd[3]) == pytest.approx(1.0) and fwd[5] == "within"
    # bwd: 3.0/3.03 and 4.2/4.2 -> geomean sqrt(0.990099 * 1).
    bwd = _geomean_line(text, "bwd", "flashhopper")
    assert float(bwd[3]) == pytest.approx(math.sqrt(3.0 / 3.03), abs=1e-4) and bwd[5] == "within"
    assert bwd[4] == f"{3.0 / 3.03:.3f} (bwd flashhopper bf16 d128 non-causal s1024 b16 h16)"
    # fp8: 0.5/0.6 and 1 -> geomean sqrt(5/6) = 0.913: slower beyond 2%, so exit 1.
    fp8 = _geomean_line(text, "fwd", "flashhopper-fp8")
    assert float(fp8[3]) == pytest.approx(math.sqrt(5 / 6), abs=1e-4) and fp8[5] == "SLOWER"
    # A per-cell line: base 1.1 (median of 1.0 and 1.2), new 1.1.
    assert "| fwd | flashhopper | bf16 | 128 | no | 1024 | 1.1000 | 1.1000 | 1.000 |" in text
    # Skipped rows are no cells.
    assert "| bwd | flashhopper-fp8" not in text and "only" not in text


def test_within_tolerance_exits_0_and_one_sided_cells_fail(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    base = _write(tmp_path / "b.json", _grid((1.0, 2.0), (3.0, 4.0), (0.5, 1.0)))
    new = _write(tmp_path / "n.json", _grid((1.01, 1.99), (3.0, 4.05), (0.5, 1.0)))
    assert compare_builds.main(["--base", str(base), "--new", str(new)]) == 0
    assert compare_builds.main(["--base", str(base), "--new", str(new), "--tolerance", "0.005"]) == 1
    capsys.readouterr()
    # A kernel the new build lost: its cells are listed and the comparison fails.
    lost = json.loads(new.read_text())
    lost["results"] = [r for r in lost["results"] if not (r["mode"] == "bwd" and r["seqlen"] == 4096)]
    new.write_text(json.dumps(lost))
    assert compare_builds.main(["--base", str(base), "--new", str(new)]) == 1
    assert "Measured in base only (1): bwd flashhopper bf16 d128 causal s4096 b4 h16" in capsys.readouterr().out


def test_labels_must_match_the_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _write(tmp_path / "b.json", _grid((1.0, 2.0), (3.0, 4.0), (0.5, 1.0)), "new")
    new = _write(tmp_path / "n.json", _grid((1.0, 2.0), (3.0, 4.0), (0.5, 1.0)), "new")
    assert compare_builds.main(["--base", str(base), "--new", str(new)]) == 2
    assert "labelled 'new' but passed as --base" in capsys.readouterr().err
    # Nothing measured on both sides proves nothing.
    empty = _write(tmp_path / "e.json", [_row("fwd", "flashhopper", 1024, False, None)])
    assert compare_builds.main(["--base", str(empty), "--new", str(empty)]) == 1
    (tmp_path / "q.json").write_text('{"rows": []}')
    assert compare_builds.main(["--base", str(tmp_path / "q.json"), "--new", str(new)]) == 2
    assert "not a bench/bench_attention.py result" in capsys.readouterr().err
