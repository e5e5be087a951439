#!/usr/bin/env python3
"""Is this GPU fit to be timed? Runs ~3 s of bf16 GEMM and samples clocks meanwhile.

Exit 1 when the SM clock under load stays far below its maximum or a thermal/hardware slowdown is
active, so that a benchmark run can stop instead of recording throttled numbers (seen on a
lent H100, 2026-11-22: 86-89 C, SM clock 480-915 MHz, every provider ~2x slower).
"""
from __future__ import annotations

import subprocess
import threading
import time

import torch

# nvidia-smi clocks_event_reasons bits that mean the chip is being slowed down.
SLOWDOWN_BITS = {0x4: "sw power cap", 0x8: "hw slowdown", 0x20: "sw thermal", 0x40: "hw thermal", 0x80: "hw power brake"}


def sample(stop: threading.Event, rows: list[list[str]]) -> None:
    while not stop.is_set():
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,temperature.gpu,power.draw,clocks_event_reasons.active",
             "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout.strip()
        rows.append([x.strip() for x in out.split(",")])
        time.sleep(0.25)


def main() -> int:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    rows: list[list[str]] = []
    stop = threading.Event()
    t = threading.Thread(target=sample, args=(stop, rows))
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    t.start()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 0
    t0 = time.time()
    start.record()
    while time.time() - t0 < 3.0:
        for _ in range(10):
            a @ b
        n += 10
        torch.cuda.synchronize()
    end.record()
    end.synchronize()
    stop.set()
    t.join()
    tflops = 2 * 8192**3 * n / (start.elapsed_time(end) * 1e-3) / 1e12
    load = rows[2:] or rows
    clocks = sorted(int(r[0]) for r in load)
    max_clock = int(load[0][1])
    temp = max(int(r[2]) for r in load)
    reasons = 0
    for r in load:
        reasons |= int(r[4], 16)
    slow = [name for bit, name in SLOWDOWN_BITS.items() if reasons & bit]
    median_clock = clocks[len(clocks) // 2]
    print(f"{torch.cuda.get_device_name()}: bf16 GEMM {tflops:.0f} TFLOPS, SM clock under load median {median_clock} "
          f"MHz (max {max_clock}), {temp} C, slowdowns: {', '.join(slow) or 'none'}")
    # A power cap under sustained GEMM is the H100's normal state (seen: 1410 MHz, 53 C, 679 TFLOPS);
    # thermal or hardware slowdowns, or clocks far below that, are not.
    throttled = median_clock < 0.6 * max_clock or any(s in ("sw thermal", "hw thermal", "hw slowdown") for s in slow)
    if throttled:
        print("GPU IS THROTTLED: timings from this machine are not comparable")
    return 1 if throttled else 0


if __name__ == "__main__":
    raise SystemExit(main())
