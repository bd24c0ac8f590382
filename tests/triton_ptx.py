"""A Triton kernel compiled to PTX for sm_90 on the CPU (no GPU needed), as a launch on 16-byte
aligned tensors specialises it: for tests that check the instructions a kernel lowers to
(tests/test_row_accumulate.py, tests/test_qk_norm_rope.py). Not a test module itself.
"""

import re


def sm90_ptx(kernel, types: dict[str, str], constexprs: dict, aligned: list[str]) -> str:
    """PTX of `kernel` (@triton.jit) with its arguments typed by `types` (name -> Triton type,
    e.g. "*fp32", "i32") or bound by `constexprs`, and the arguments named in `aligned` (pointers,
    strides) known divisible by 16."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    names = list(kernel.arg_names)
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=kernel, signature=signature, attrs=attrs, constexprs=constexprs)
    return triton_compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def global_accesses(ptx: str, op: str) -> set[str]:
    """The distinct global-memory instructions of kind `op` ("ld", "st" or "atom") in `ptx`."""
    return set(re.findall(rf"{op}\.global[\w.]*", ptx))
