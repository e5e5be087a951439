#!/usr/bin/env python3
"""Count the instructions that prove each kernel uses the Hopper mechanisms.

    cuobjdump --dump-sass _C.so > sass.txt && python scripts/sass_summary.py sass.txt
HGMMA/QGMMA: WGMMA; UTMALDG/UTMASTG: TMA load/store; SYNCS: mbarrier ops; USETMAXREG: setmaxnreg;
HMMA: mma.sync (sm80 path); LDGSTS: cp.async; LDL/STL: local memory (spills).
"""
import re
import sys
from collections import Counter

OPS = ["HGMMA", "QGMMA", "UTMALDG", "UTMASTG", "SYNCS", "USETMAXREG", "HMMA", "LDGSTS", "LDSM", "STSM", "MUFU.EX2",
       "BAR.SYNC", "BAR.ARV", "LDL", "STL"]


def main(path: str) -> None:
    text = open(path).read()
    # cuobjdump prints "Function : <mangled>" before each kernel's code.
    parts = re.split(r"\n\s*Function : (\S+)\n", text)
    rows = []
    for name, body in zip(parts[1::2], parts[2::2]):
        c = Counter()
        for op in OPS:
            c[op] = len(re.findall(r"\b" + re.escape(op) + r"\b", body))
        rows.append((short(name), c))
    width = max((len(n) for n, _ in rows), default=10)
    print(f"{'kernel':<{width}} " + " ".join(f"{op:>10}" for op in OPS))
    for n, c in rows:
        print(f"{n:<{width}} " + " ".join(f"{c[op]:>10}" for op in OPS))


def short(mangled: str) -> str:
    # ...FwdMainloopIN7cutlass10bfloat16_tELi128ENS0_11FwdTileSizeILi128ELb1EEELb1EEE...
    m = re.search(r"FwdMainloopIN7cutlass\d+(\w+?)ELi(\d+)E.*?FwdTileSizeILi\d+ELb[01]EEELb([01])", mangled)
    if m:
        dt = "bf16" if "bfloat16" in m.group(1) else "fp16"
        return f"sm90_fwd_{dt}_d{m.group(2)}{'_causal' if m.group(3) == '1' else ''}"
    return mangled[:80]


if __name__ == "__main__":
    main(sys.argv[1])
