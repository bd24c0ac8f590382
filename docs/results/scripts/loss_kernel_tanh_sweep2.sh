#!/usr/bin/env bash
# Twelfth lease, call 7 (one H200, warm from call 6; no carry): the softcap-CE kernel alone at
# keys C and A for ten launches, the sigmoid as exp (ex2 + rcp) or as tanh.approx, 3 untimed and
# 25 timed calls each (CUDA events, median / p10 / p90) -> docs/results/loss_kernel_tanh_h200_2026-12-02/tanh_sweep2.log.
# Run from the repo root with $OUT set: bash docs/results/scripts/loss_kernel_tanh_sweep2.sh
export PYTHONPATH=. PYTHONUNBUFFERED=1; python3 - > $OUT/tanh_sweep2.log 2>&1 <<'PY'
import torch, statistics
from track_1_short.kernels.softcap_ce import LaunchConfig, softcap_ce_rows_
from bench.loss_kernel import make_inputs, loss_keys, FULL_SHAPES
dev = torch.device("cuda")
for key in loss_keys("C,A", False):
    x, w, targets, mtp, pw, prefix = make_inputs(key, FULL_SHAPES, dev, seed=0)
    z = torch.mm(x.detach(), w.detach())
    for cfg in [(4096,8,8,False),(2048,4,8,True),(4096,8,8,True),(2048,4,16,True),(2048,8,4,True),(1024,4,8,True),(2048,4,4,True),(1024,2,16,True),(4096,4,8,True),(2048,4,8,False)]:
        L = LaunchConfig(block_v=cfg[0], num_warps=cfg[1], programs_per_sm=cfg[2], tanh_sigmoid=cfg[3])
        for _ in range(3): softcap_ce_rows_(z, targets, mtp, pw, prefix, L)
        ts = []
        for _ in range(25):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); softcap_ce_rows_(z, targets, mtp, pw, prefix, L); b.record(); b.synchronize()
            ts.append(a.elapsed_time(b))
        ts.sort()
        print(key.name, cfg, "median %.3f p10 %.3f p90 %.3f" % (statistics.median(ts), ts[2], ts[22]), flush=True)
    del z, x, w
    torch.cuda.empty_cache()
PY
cat $OUT/tanh_sweep2.log | grep -v Warn
