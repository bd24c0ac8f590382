"""CUDA-graph capture for the GPU tests: a step run on a side stream until compile, kernel JIT,
autotuning and the allocator have settled, then captured once (the pattern of torch.cuda.graphs'
documentation). Imported by the *_gpu.py test files; collects no tests."""

from collections.abc import Callable

import torch


def warm_and_capture(step: Callable[[], object], warm_iterations: int = 2):
    """(graph, what step returned during capture): `step` runs `warm_iterations` times on a side
    stream, then once under torch.cuda.graph. Its outputs are the graph's static outputs, which
    graph.replay() rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm_iterations):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured
