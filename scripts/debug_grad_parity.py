"""GPU debug: per-parameter gradient parity of (uncompiled eager, compiled eager, step graph) on the
tiny GPT at one key. Prints a table; run: PYTHONPATH=. python scripts/debug_grad_parity.py"""
import sys
import torch
sys.path.insert(0, ".")
from tests import test_step_graphs_gpu as t
from track_1_short.perf.cuda_graphs.capture_support import loss_grads
from track_1_short.perf.cuda_graphs.step_graphs import training_loss

dev = torch.device("cuda")
model, fwd, runner = t._build(dev)
step = 0
batch, slots, cfg, loss = t._run_step(model, runner, step, dev)
cs = runner.captured[runner.step_keys[step]]
graph = {p: g.clone() for p, g in cs.grads}
ref_loss, ref, _ = t._eager_reference(model, batch, slots, cfg)
sink = torch.zeros_like(model.ngram_table.grad_sink(batch.inputs.numel()), requires_grad=True)
scratch = torch.zeros_like(model.value_embeds.grad_accum)
closs = training_loss(fwd, batch.inputs, batch.targets, batch.cum_seqlens, slots, cfg, sink, scratch)
params = list(model.parameters())
cgrads = dict(zip(params, loss_grads(closs, params + [sink])[:-1]))
print("loss graph", loss, "ref", ref_loss, "compiled", closs.item())
for name, p in model.named_parameters():
    if p not in graph:
        continue
    r = ref[p]
    e = lambda a: ((a.float() - r.float()).norm() / r.float().norm().clamp_min(1e-12)).item()
    print(f"{name:24s} |ref| {r.norm().item():10.4e}  compiled {e(cgrads[p]):9.2e}  graph {e(graph[p]):9.2e}"
          f"  graph-vs-compiled {((graph[p]-cgrads[p]).norm()/cgrads[p].norm().clamp_min(1e-12)).item():9.2e}")
    if name == "x0_lambdas":
        print("  ref", r.tolist()); print("  cmp", cgrads[p].tolist()); print("  gr ", graph[p].tolist())
