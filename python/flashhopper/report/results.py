"""The report's results file, and reading results written by bench/bench_attention.py.

Report format ("format": FORMAT): environment (device, date, versions, git commit, timer, command),
config (the options), ceilings (measured GEMM and copy), datasheet (peaks and their source, null
for an unknown device) and rows (measurements plus the derived columns of metrics.COLUMNS).
A bench file ({"environment", "args", "results"}) has no ceilings: they stay unmeasured (n/a), and
only the datasheet peaks looked up by its device name are used.
"""
from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import metrics
from .ceilings import datasheet_for

FORMAT = "flashhopper-report/1"


@dataclass
class Report:
    environment: dict[str, Any]
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    ceilings: dict[str, Any] | None  # None: not measured (a bench file)
    datasheet: dict[str, Any] | None  # None: unknown device
    source: Path | None = None  # the file it was read from; None when measured in this run

    @property
    def device(self) -> str:
        return str(self.environment.get("device", "unknown device"))

    @property
    def date(self) -> str:
        return str(self.environment.get("date", "unknown date"))

    def derived(self) -> list[dict[str, Any]]:
        return metrics.derive(self.rows, self.ceilings, self.datasheet)


def to_json(report: Report) -> dict[str, Any]:
    return {"format": FORMAT, "environment": report.environment, "config": report.config,
            "ceilings": report.ceilings, "datasheet": report.datasheet, "rows": report.derived()}


def load(path: Path) -> Report:
    """A report file or a bench_attention.py file; ValueError if it is neither."""
    doc = json.loads(Path(path).read_text())
    if isinstance(doc, dict) and doc.get("format") == FORMAT:
        return Report(doc["environment"], doc.get("config", {}), doc["rows"], doc.get("ceilings"),
                      doc.get("datasheet"), Path(path))
    if isinstance(doc, dict) and {"environment", "results"} <= doc.keys():
        if not all(isinstance(r, dict) and "mode" in r for r in doc["results"]):  # e.g. bench_quant.py's
            raise ValueError(f"{path}: a bench result, but not of attention (rows without a mode)")
        env = doc["environment"]
        return Report(env, doc.get("args", {}), doc["results"], None, datasheet_for(env.get("device", "")), Path(path))
    raise ValueError(f"{path}: neither a flashhopper-report file nor a bench/bench_attention.py result")


def _when(report: Report) -> dt.datetime:
    when = dt.datetime.fromisoformat(report.date)
    return when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)


def newest(folder: Path) -> Path | None:
    """The results file in ``folder`` with the latest date inside it, report files (the whole sweep
    with its ceilings) before bench files (often a few providers or shapes); files that are not
    attention results or carry no date are passed over."""
    dated: list[tuple[bool, dt.datetime, str, Path]] = []
    for path in Path(folder).glob("*.json"):
        try:
            report = load(path)
            is_report = json.loads(path.read_text()).get("format") == FORMAT
            dated.append((is_report, _when(report), path.name, path))
        except (OSError, ValueError, KeyError, AttributeError):
            continue
    return max(dated)[3] if dated else None
