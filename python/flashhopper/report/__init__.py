"""The TFLOPS-utilization report: ``flashhopper-report`` / ``python -m flashhopper.report``.

One concept per module: ``timing`` (GPU medians), ``providers`` (who is timed), ``fa3`` (finding
FlashAttention-3, a peer, imported only when asked for), ``sweep`` (shapes and the timing loop),
``ceilings`` (measured GEMM/copy, datasheet peaks), ``io_model`` (HBM bytes, standard attention vs ours),
``metrics`` (derived columns), ``results`` (the JSON files), ``render`` (tables, CSV, plots), ``cli``.
bench/bench_attention.py shares timing, providers and sweep.
"""
