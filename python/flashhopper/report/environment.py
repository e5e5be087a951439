"""Where a measurement came from: device, versions, git commit, date, command."""
from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import flashhopper

from . import fa3


def source_root() -> Path | None:
    """The flashhopper source tree: the one this code runs from (PYTHONPATH=python, an editable
    install), else the current directory if it is one; None for a wheel run from elsewhere."""
    for cand in (Path(__file__).resolve().parents[3], Path.cwd()):
        if (cand / "python" / "flashhopper").is_dir() and (cand / "pyproject.toml").is_file():
            return cand
    return None


def git_commit(root: Path | None) -> str | None:
    """HEAD of the source tree; the device machine gets a copy without .git, so there the caller
    passes it in FLASHHOPPER_GIT_COMMIT."""
    if os.environ.get("FLASHHOPPER_GIT_COMMIT"):
        return os.environ["FLASHHOPPER_GIT_COMMIT"]
    if root is None:
        return None
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("-dirty" if dirty else "")


def environment(timer: str, root: Path | None) -> dict[str, Any]:
    """The current CUDA device, library versions and run metadata."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "num_sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "flashhopper": flashhopper.__version__,
        "flashhopper_build": flashhopper.build_info(),
        "flashhopper_kernels": len(flashhopper.compiled_kernels()),
        "git_commit": git_commit(root),
        "fa3_path": None if fa3.path() is None else str(fa3.path()),  # the FA3 build timed as a peer
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "timer": timer,
        "command": " ".join(sys.argv),
    }
