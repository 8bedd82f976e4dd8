"""Register-operand backend (Gluon, sm_90): packed codes become tensor-core operands in registers,
two codes per instruction, for plans with one scale and zero per token (lower.py says which).

lower.py reads the plan, operands.py holds the unpack PTX and the channel maps, kernel.py the
Gluon kernel (GPU only), launch.py the attention callable, aot.py ahead-of-time builds."""
from .launch import GluonAttention
from .lower import FoldKernel, NotLowerable, gluon_plan, lower, lowerable

__all__ = ["FoldKernel", "GluonAttention", "NotLowerable", "gluon_plan", "lower", "lowerable"]
