"""A `PagedDecodeWrapper` on the register-operand launcher whose decode and merge launches stand in (CPU): what a
wrapper on sm_90 does on its host side, the launches recorded instead of run."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from _kernel_cases import LaunchRecorder  # noqa: E402

from foldc.backends.gluon.launch import GluonAttention  # noqa: E402


class _Resident(GluonAttention):
    def resident(self, *a):   # no GPU to compile on
        return 12


def stand_in_register_operand(wrapper, spec, monkeypatch, block_n: int = 64) -> tuple:
    """Point ``wrapper`` (before its ``plan``) at the register-operand launcher with stand-in launches, for fp16 and
    bf16 queries; returns the decode's and the merge's `LaunchRecorder`."""
    attn = _Resident(spec, block_n=block_n)
    decode, merge = LaunchRecorder(), LaunchRecorder()
    monkeypatch.setattr(attn, "_launchers", lambda: (decode, merge))
    wrapper.attention, wrapper.register_operand, wrapper.interpret = attn, True, False
    wrapper._dtypes = (torch.float16, torch.bfloat16)
    return decode, merge
