"""foldc/backends/runtime/modules.py: a generated module loaded for Triton's interpreter runs a loop over
runtime bounds under any NumPy (triton 3.6 converts its 1-element scalars with ``int()``, which NumPy 2.4
refuses and 1.25-2.3 warn about)."""
from __future__ import annotations

import warnings

import torch

from foldc.backends.runtime.modules import interpreter, load_module

# a loop whose bounds are runtime values: a loaded length and a program id, 1-element arrays in the interpreter
SOURCE = '''import triton
import triton.language as tl


@triton.jit
def loop_over_runtime_bounds(LENS, OUT, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    end = tl.load(LENS + pid)
    total = 0
    for start in range(pid, end, BLOCK):
        total += start
    tl.store(OUT + pid, total)
'''


def test_an_interpreted_loop_over_runtime_bounds_runs_and_leaves_no_index_behind():
    import triton.language as tl

    kernel = load_module(SOURCE, interpret=True).loop_over_runtime_bounds
    lens = torch.tensor([9, 20, 2], dtype=torch.int32)
    out = torch.full((3,), -1, dtype=torch.int32)
    with warnings.catch_warnings():
        # NumPy 1.25-2.3 warn where 2.4 raises: an error either way
        warnings.filterwarnings("error", "Conversion of an array with ndim > 0", DeprecationWarning)
        with interpreter(True):
            kernel[(3,)](lens, out, BLOCK=4)
    want = [sum(range(pid, int(end), 4)) for pid, end in enumerate(lens.tolist())]
    assert out.tolist() == want == [12, 45, 0]
    assert not hasattr(tl.tensor, "__index__")   # set for the launch only, as triton's own patch is
