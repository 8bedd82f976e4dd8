"""How the split count decides the register-operand kernel's time: for a few shapes and launch
options, time explicit split counts and print each with the programs it launches, the kernel's
registers and the waves of resident programs that makes (the first row of each: the launcher's
own choice) (H200; evidence for docs/perf.md, not a test).

    PYTHONPATH=. python3 benchmarks/split_sweep.py --out results/splits.json
"""
from __future__ import annotations

import argparse
import sys

import torch

import foldc
from foldc.bench import decode_case, save_rows, timed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="2:8x65536,2:32x16384,4:32x16384,4:8x65536,2:32x65536")
    ap.add_argument("--configs", default="2:64:192,2:64:none,2:32:128,4:32:none,4:32:168,4:32:128",
                    help="bits:block_n:maxnreg")
    ap.add_argument("--waves", default="0.5,0.75,0.9,1,1.1,1.25,1.5,1.75,2,2.5,3")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for case in args.cases.split(","):
        bits, shape = case.split(":")
        bits = int(bits)
        b, n = (int(x) for x in shape.split("x"))
        enc = foldc.Affine(bits, "token", 128)
        spec = foldc.AttentionSpec(32, 8, 128, enc, enc)
        q, k, v = decode_case(spec, b, n, seed=b * n + bits)
        for conf in args.configs.split(","):
            cb, bn, reg = conf.split(":")
            if int(cb) != bits:
                continue
            opts = dict(block_n=int(bn), stages=2, **({} if reg == "none" else {"maxnreg": int(reg)}))
            probe = foldc.compile(spec, "sm_90", kernel="gluon", **opts)
            launch = probe.launch_config(q.dtype, b, n)
            resident = probe.resident(launch, q.dtype, False, 0, q.device)
            n_regs = launch[("registers", False, 0)]
            groups = b * 8 // probe.heads
            seen = set()
            for w in [None] + [float(x) for x in args.waves.split(",")]:   # None: the launcher's own choice
                want = None if w is None else max(1, round(w * sms * resident / groups))
                attn = foldc.compile(spec, "sm_90", kernel="gluon", splits=want, **opts)
                splits, per_split = attn.split_plan(attn.launch_config(q.dtype, b, n), b, n, q.device)
                if w is not None and splits in seen:
                    continue
                seen.add(splits)
                eager, graph = timed(lambda attn=attn, q=q, k=k, v=v: attn(q, k, v))
                best = min(t for t in (eager, graph) if t is not None)
                programs = groups * splits
                row = dict(bits=bits, batch=b, tokens=n, block_n=int(bn), maxnreg=reg, n_regs=n_regs, default=w is None,
                           resident=resident, splits=splits, per_split=per_split, programs=programs,
                           waves=programs / (sms * resident), us=best)
                rows.append(row)
                print(f"INT{bits} {b}x{n} bn{bn} reg{reg} ({n_regs} regs, {resident}/SM) "
                      f"{'default' if w is None else 'splits'} {splits:4d} "
                      f"({per_split} tok) programs {programs:5d} waves {row['waves']:.2f}: {best:.1f} us", flush=True)
        del q, k, v
        save_rows(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
