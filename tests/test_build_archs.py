"""FLASHHOPPER_ARCHS=auto, the default of `pip install .`: which kernel families cmake/DetectGpuArchs.cmake
builds for the compute capabilities it finds (the mapping is run by cmake itself, in script mode)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[1] / "cmake" / "DetectGpuArchs.cmake"


def archs_for(caps: str, tmp: Path) -> tuple[str, str]:
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake on PATH")
    # A script file, not /dev/stdin: some cmake builds refuse a pipe ("File not seekable").
    script = tmp / "archs.cmake"
    script.write_text(f'include("{MODULE.as_posix()}")\n'
                      f'flashhopper_archs_for_caps("{caps}" archs from)\n'
                      'message(NOTICE "archs=${archs}|from=${from}")\n')
    run = subprocess.run([cmake, "-P", str(script)], capture_output=True, text=True, check=True)
    line = next(s for s in run.stderr.splitlines() if s.startswith("archs="))
    archs, origin = line.removeprefix("archs=").split("|from=")
    return archs, origin


@pytest.mark.parametrize(("caps", "archs"), [
    ("9.0", "90"),                 # H100/H200: the Hopper family only
    ("8.0", "80"), ("8.6", "80"), ("8.9", "80"),  # A100, A10/RTX 30xx, L4/RTX 40xx: the Ampere family
    ("9.0;8.0", "90;80"), ("8.6;9.0;9.0", "90;80"),  # both kinds visible: both, each once
    ("", "90;80"),                 # no GPU visible: build for whichever it will meet
    ("12.0", "90;80"), ("7.5", "90;80"),  # only unsupported GPUs: as if none
    ("10.0;8.6", "80"),            # an unsupported GPU beside a supported one: the supported one's family
])
def test_auto_archs(caps: str, archs: str, tmp_path: Path) -> None:
    got, origin = archs_for(caps, tmp_path)
    assert got == archs
    assert origin.startswith("auto, ")
    assert ("no GPU visible" in origin) == (caps == "")
