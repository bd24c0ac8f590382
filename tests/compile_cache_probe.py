"""Subprocess of tests/test_compile_cache.py: load the cache file (if any), compile a small
forward + backward with inductor on CPU, save the cache, print the counters as JSON."""

import sys, time, json
from pathlib import Path
import torch
from track_1_short.perf import compile_cache
path = Path(sys.argv[1])
info = compile_cache.load(path)
t=time.perf_counter()
@torch.compile(fullgraph=True, dynamic=False)
def f(x, w):
    return torch.relu(x @ w).square().sum()
x = torch.randn(8, 16, requires_grad=True); w = torch.randn(16, 4, requires_grad=True)
f(x, w).backward()
c = torch._dynamo.utils.counters
print(json.dumps({"load": info, "compile_s": time.perf_counter()-t, "fx_hit": c["inductor"]["fxgraph_cache_hit"], "fx_miss": c["inductor"]["fxgraph_cache_miss"], "aot_hit": c["aot_autograd"]["autograd_cache_hit"], "graphs": compile_cache.graphs_compiled(), "save": compile_cache.save(path)}))
