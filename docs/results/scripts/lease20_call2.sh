#!/usr/bin/env bash
# Twentieth lease, call 2, right after call 1 on the same warm machine (carry [".carry/fa4a"]): the
# change side by side at A, ours alone (fp8 lm head, recompute, the q/k kernel; default attention
# and MLP: fa4 and quack need call 3's carry): train.embed_grad=pull (default) then dense, 20 timed
# steps each, kernel time per step from the profiler. Prediction: pull ~1.2 ms per step less kernel
# time than dense (the dense [V, D] backward does not shrink with T).
source scripts/gpu/common.sh
set_items=(--set model.fp8.enabled=true --set model.fp8.sites=lm_head
           --set train.fused_loss_schedule=recompute --set train.qk_norm_rope=triton)
for grad in pull dense; do
  limit=270; [[ $grad == dense ]] && limit=$(( $(left) - 15 ))
  timeout -k 10 $limit python3 bench/step.py --stage A --steps 20 \
      --graphs on --micro-steps 8 --data-dir data/embedded "${set_items[@]}" \
      --set train.embed_grad=$grad --out "$OUT/a_$grad.json" > "$L/a_$grad.log" 2>&1
  echo "exit $? after $(elapsed) s" >> "$L/a_$grad.log"
done
tail -n 3 "$L"/a_*.log
python3 - "$OUT" <<'PY'
import json, sys
for g in ("pull", "dense"):
    try:
        v = json.load(open(f"{sys.argv[1]}/a_{g}.json"))["variants"]["on"]
        print(g, "step", round(v["step_ms"]["median_ms"], 2), "kernel", round(v["kernel_ms_per_step"], 2),
              "micro", round(v["phases_ms"]["micro_step_ms"], 3), "warmup", round(v["warmup_s"]))
    except (OSError, KeyError) as e:
        print(g, "missing", e)
PY
