"""The README's main job runs (on CPU here: the reference path, saying there is no GPU)."""
from __future__ import annotations

import re

import pytest
import torch

from flashhopper import demo


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA demo runs in the GPU workflow")
def test_demo_without_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--iters", "2"]) == 0
    text = capsys.readouterr().out
    assert "no CUDA GPU found" in text
    errors = [float(e) for e in re.findall(r"\|\|out-ref\|\|/\|\|ref\|\| = ([0-9.e+-]+)", text)]
    assert len(errors) == 2 and all(0 < e < 1e-2 for e in errors)  # bf16 rounding, nothing worse
