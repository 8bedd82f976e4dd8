"""Backends that lower a plan: gluon (the register-operand kernel, sm_90 and sm_100) and triton (the
generated portable kernel: sm_90, sm_100 and Triton's interpreter), over the runtime they share
(runtime/). Importing this package registers both with the core (foldc/registry.py)."""
from . import gluon, triton  # noqa: F401 - registration

__all__ = ["gluon", "triton"]
