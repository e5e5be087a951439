"""FlashAttention-3, a peer to time against: a measuring instrument, never a dependency.

Found in a folder holding FA3's ``flash_attn_interface.py`` and its compiled ``flash_attn_3/`` (e.g.
a build from the public Dao-AILab/flash-attention ``hopper/`` sources), named by ``--fa3-path`` of
flashhopper-report and bench/bench_attention.py or by the environment variable FLASHHOPPER_FA3_PATH.
Imported only when a provider asks for it; one FA3 per process (it registers ``torch.ops.flash_attn_3``).
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

ENV = "FLASHHOPPER_FA3_PATH"
_option: Path | None = None  # --fa3-path, which wins over the environment
_loaded: dict[Path, ModuleType | str] = {}  # folder -> the module, or why it did not import


def set_path(path: Path | None) -> None:
    """Use FA3 from ``path`` (the --fa3-path option); None: from FLASHHOPPER_FA3_PATH, if set."""
    global _option
    _option = path


def path() -> Path | None:
    """The folder FA3 is taken from, None when neither the option nor the environment names one."""
    if _option is not None:
        return _option
    env = os.environ.get(ENV)
    return Path(env) if env else None


def configured() -> bool:
    return path() is not None


def _import(folder: Path) -> ModuleType | str:
    if not (folder / "flash_attn_interface.py").is_file() or not (folder / "flash_attn_3").is_dir():
        return f"{folder} holds no FA3 build (flash_attn_interface.py and flash_attn_3/)"
    entry = str(folder)
    sys.path.insert(0, entry)  # flash_attn_interface imports flash_attn_3 and flash_attn_config from there
    try:
        module = importlib.import_module("flash_attn_interface")
    except Exception as e:  # noqa: BLE001  (an ABI mismatch, a missing CUDA library: any failure is a reason to skip)
        sys.path.remove(entry)
        return f"importing FA3 from {folder} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    origin = Path(module.__file__ or "").resolve().parent
    if origin != folder:
        return f"FA3 was already imported from {origin} in this process; {folder} cannot be imported beside it"
    return module


def load() -> ModuleType:
    """FA3's ``flash_attn_interface`` module, imported on first use; ImportError saying why it is
    not available (nothing configured, no FA3 in the folder, the import failed)."""
    folder = path()
    if folder is None:
        raise ImportError(f"FA3 is not configured: pass --fa3-path or set {ENV} to a folder with "
                          "flash_attn_interface.py and flash_attn_3/")
    folder = folder.resolve()
    if folder not in _loaded:
        _loaded[folder] = _import(folder)
    got = _loaded[folder]
    if isinstance(got, str):
        raise ImportError(got)
    return got
