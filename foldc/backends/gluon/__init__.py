"""Register-operand backend (Gluon, sm_90 and sm_100): packed codes become tensor-core operands in
registers, two codes per instruction, for the plans lower.py accepts.

lower.py reads the plan, operands.py holds the unpack PTX and the channel maps, kernel.py the
Gluon kernel (GPU only), launch.py the attention callable (launch_defaults.py its defaults, decode_args.py
the kernel's arguments, eager.py and prepared.py its bound calls), aot.py ahead-of-time builds,
describe.py `foldc explain`'s paragraph. Registered as the "gluon" attention backend. The GEMV:
gemv_lower.py reads the GEMM plan, gemv.py (the program) and gemv_chunk.py (one chunk's arithmetic)
are its kernel, gemv_launch.py its callable, gemv_aot.py its ahead-of-time builds."""
from ...registry import AttentionBackend, register_backend
from .describe import describe
from .launch import GluonAttention
from .lower import FoldKernel, NotLowerable, gluon_plan, lower, lowerable
from .tuning import GLUON_CANDIDATES, GluonConfig   # registers its tuning config


def _kernel(spec, target, **options):
    return GluonAttention(spec, target=target, **options)


def _target_plan(spec, dtype, fold_policy="auto"):
    return gluon_plan(spec, dtype)   # the register-operand kernel folds where the plan says; no policy


register_backend(AttentionBackend("gluon", ("sm_90", "sm_100"), _kernel, _target_plan, lowerable, describe))

__all__ = ["FoldKernel", "GLUON_CANDIDATES", "GluonAttention", "GluonConfig", "NotLowerable", "gluon_plan", "lower", "lowerable"]
