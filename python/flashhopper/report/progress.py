"""A progress bar for the sweep on stderr (stdout keeps the report): rich when it is installed,
otherwise one rewritten line."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from .sweep import Progress


@contextlib.contextmanager
def progress_bar(what: str) -> Iterator[Progress]:
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn
    except ImportError:
        def line(done: int, total: int, desc: str) -> None:
            print(f"\r{what} [{done}/{total}] {desc:<60}", end="", file=sys.stderr, flush=True)

        try:
            yield line
        finally:
            print(file=sys.stderr)
        return
    columns = (TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    with RichProgress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("", total=None)

        def update(done: int, total: int, desc: str) -> None:
            bar.update(task, completed=done, total=total, description=desc)

        yield update
