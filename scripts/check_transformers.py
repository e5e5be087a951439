#!/usr/bin/env python3
"""Hugging Face transformers with attn_implementation="FlashHopper" (flashhopper.integrations.transformers)
on the GPU: a tiny randomly initialised Llama and Qwen2 (2 layers, hidden 512, 4 query / 2 kv heads of
128, vocab 1024) in bf16, each against "sdpa" in bf16 and the same weights in float32 (sdpa), with the
criteria of tests/test_transformers.py (its gpu test asserts the same):

- logits: relative error vs float32 of FlashHopper and of sdpa; pass iff FlashHopper's <= 2 x sdpa's + slack;
- greedy: generate() tokens equal to sdpa's, or diverging only on a near-tie of the float32 model;
- gradients of one training step, per parameter: the worst ratio of FlashHopper's error to sdpa's, and
  the parameter; pass iff every one is <= 2 x sdpa's + slack;
- time per forward (no grad) of each at --batch x --seqlen (prefill, causal).

A second table: padded batches and packed sequences, which run flash_attn_varlen_func (the checks of
tests/test_transformers.py's padded_and_packed_checks, which its gpu test asserts): logits at the real positions
of 3 x 300 tokens padded left and right, and of 2 rows of packed documents (told apart by position_ids, or by
cu_seq_lens) against each document alone, as "FlashHopper's error / sdpa's"; greedy generate() on left-padded
prompts; the worst gradient ratio of a training step on the left-padded batch and on the packed rows.

Every attention call must run the kernels (a fallback to sdpa is an error). Exit 1 if any check fails.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the criteria live with the tests

try:
    import transformers
except ImportError:
    sys.exit("check_transformers.py needs Hugging Face transformers: pip install 'transformers>=5'")

import test_transformers as tt

import flashhopper
import flashhopper.integrations.transformers as fht
from flashhopper.report.timing import Timer, make_timer


def check(family: str, batch: int, seqlen: int, timer: Timer) -> tuple[list[str], list[str]]:
    """One table row and the failures (empty when it passes)."""
    model = tt.tiny_model(family, hidden=512, vocab=1024, dtype=torch.bfloat16, device="cuda")
    ref = tt.reference_model(model)
    ids = torch.randint(1, 1024, (2, 300), device="cuda")
    failures = []

    err, sdpa_err, vs_sdpa = tt.logits_errors(model, ref, ids)
    if not tt.within_noise(err, sdpa_err):
        failures.append(f"logits: error {err:.3e} > 2 x sdpa's {sdpa_err:.3e}")
    agreement = tt.greedy_agreement(model, ref, ids[:, :100], steps=8)
    failures += [f"greedy: {f}" for f in agreement.failures]

    model.train()
    grads = tt.grad_errors(model, ref.train(), ids)
    failures += [f"{n}.grad: error {e:.3e} > 2 x sdpa's {s:.3e}" for n, (e, s) in grads.items()
                 if not tt.within_noise(e, s)]
    worst, (g_err, g_sdpa) = max(grads.items(), key=lambda kv: kv[1][0] / max(kv[1][1], 1e-30))
    model.eval()

    long_ids = torch.randint(1, 1024, (batch, seqlen), device="cuda")
    ms = {}
    with torch.no_grad():
        for implementation in (tt.NAME, "sdpa"):
            with tt.attn(model, implementation):
                ms[implementation] = timer(lambda: model(long_ids))
    row = [family, f"{err:.2e}", f"{sdpa_err:.2e}", f"{vs_sdpa:.2e}", agreement.summary(),
           f"{g_err / g_sdpa:.2f} ({worst})", f"{ms[tt.NAME]:.3f}", f"{ms['sdpa']:.3f}",
           "ok" if not failures else "FAIL"]
    return row, failures


def check_varlen(family: str) -> tuple[list[str], list[str]]:
    """The padded / packed table's row and its failures."""
    model = tt.tiny_model(family, hidden=512, vocab=1024, dtype=torch.bfloat16, device="cuda")
    cells, failures = tt.padded_and_packed_checks(model, tt.reference_model(model), vocab=1024, seqlen=300)
    return [family, *cells.values(), "ok" if not failures else "FAIL"], failures


VARLEN_HEADERS = ["model", "left-padded logits", "right-padded logits", "left-padded greedy vs sdpa",
                  "packed logits (position_ids)", "packed logits (cu_seq_lens)",
                  "left-padded grad err / sdpa's (worst)", "packed grad err / sdpa's (worst)", "check"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=4, help="batch of the timed forward")
    ap.add_argument("--seqlen", type=int, default=4096, help="tokens per row of the timed forward")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("check_transformers.py needs a CUDA device")
    warnings.simplefilter("error", fht.SdpaFallbackWarning)
    timer_name, timer = make_timer(warmup_ms=25, rep_ms=100)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"seed {args.seed}; backends {flashhopper.available_backends()}; time: {timer_name}, forward of "
          f"{args.batch} x {args.seqlen} tokens")
    torch.manual_seed(args.seed)
    rows, varlen_rows, failures = [], [], []
    for family in tt.FAMILIES:
        row, fails = check(family, args.batch, args.seqlen, timer)
        rows.append(row)
        failures += [f"{family}: {f}" for f in fails]
        row, fails = check_varlen(family)
        varlen_rows.append(row)
        failures += [f"{family} (padded / packed): {f}" for f in fails]
    print(tabulate(rows, headers=["model", "logits err FlashHopper", "sdpa bf16", "FlashHopper vs sdpa",
                                  "greedy vs sdpa", "grad err / sdpa's (worst)", "ms FlashHopper", "ms sdpa",
                                  "check"], tablefmt="github"))
    print("\nPadded batches and packed sequences (flash_attn_varlen_func); logits: FlashHopper's error / sdpa's\n")
    print(tabulate(varlen_rows, headers=VARLEN_HEADERS, tablefmt="github"))
    print("errors: relative, vs the same weights in float32 (packed: each document on its own); pass: FlashHopper's "
          f"<= 2 x sdpa's + {tt.SLACK} (logits, each gradient); greedy: equal, or a near-tie of the float32 model")
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
