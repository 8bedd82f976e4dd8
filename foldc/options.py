"""Launch options of foldc's kernels: one set of rules for `foldc.compile`, the launchers, the
ahead-of-time builders and `foldc compile` (the CLI), checked before anything is planned,
printed or compiled.

Ranges (what the kernels compile and launch with):

- ``block_n`` (tokens per tile): generated Triton kernel a power of two in [16, 256] (16 is
  tl.dot's smallest N; 256 tokens already hold 64 KB of fp16 K and V per 128 channels);
  register-operand kernel 32 or 64;
- ``num_warps``: a power of two in [1, 32] (32 warps = 1024 threads, the CUDA block maximum);
  the register-operand kernel runs one warp per program and takes none;
- ``num_stages`` (Triton software pipelining): 1 to 8; ``stages`` (register-operand kernel's
  code tiles in flight): 2, 3 or 4;
- ``splits`` (split-KV count): a positive integer;
- GEMM tiles ``block_m``, ``block_n``, ``block_k``: powers of two in [16, 256]; ``split_k`` 1-64.

None means "the default" everywhere; 0 is an error, never a default. Target "reference" (the
float64 executor) launches no kernel and takes none of these.
"""
from __future__ import annotations

import numbers
import operator
import os
import tempfile
from pathlib import Path

from .errors import SpecError
from .registry import attention_backend, workload_of

KERNELS = ("auto", "triton", "gluon")
BLOCK_N = (16, 256)
GLUON_BLOCK_N = (32, 64)
NUM_WARPS = (1, 32)
NUM_STAGES = (1, 8)
GLUON_STAGES = (2, 3, 4)
GEMM_TILE = (16, 256)
SPLIT_K = (1, 64)
#: launch options of each kernel, by their Python names
ATTENTION_LAUNCH = ("block_n", "num_warps", "num_stages")
GEMM_LAUNCH = ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")
#: the CLI flag of each option the command line takes
FLAGS = {"block_n": "--block-n", "num_warps": "--num-warps", "num_stages": "--num-stages"}


def _named(name: str, value) -> str:
    return f"{name}={value!r}" + (f" ({FLAGS[name]})" if name in FLAGS else "")


def as_int(value):
    """``value`` as a Python int where it is an integer of another kind (a NumPy integer, a 0-dim torch integer
    tensor), else unchanged (for `check_int` to refuse by name: floats, bools, text...)."""
    if isinstance(value, (bool, int)) or str(getattr(value, "dtype", "")) == "torch.bool":   # (a bool: refused)
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def check_int(name: str, value, low: int, high: int | None = None, power_of_two: bool = False,
              what: str = "") -> int:
    """``value`` if it is an int (not a bool) in [low, high] (a power of two if asked), else SpecError."""
    ok = not isinstance(value, bool) and isinstance(value, int) and value >= low and (high is None or value <= high)
    if ok and power_of_two and value & (value - 1):
        ok = False
    if not ok:
        if power_of_two:
            rule = f"a power of two >= {low}"
        else:
            rule = "a positive integer" if low == 1 else f"an integer >= {low}"
        if high is not None:
            rule += f" and <= {high}" if power_of_two or low != 1 else f" <= {high}"
        raise SpecError(f"{name}={value!r} must be {rule}" + (f" ({what})" if what else ""))
    return value


def _whole(value) -> bool:
    """An integer (Python's or NumPy's), not a bool or a float that equals one."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_block_n(block_n, kernel: str = "triton") -> int | None:
    """Tokens per tile of the attention kernel ``kernel`` ("triton" or "gluon"); None: the default."""
    if block_n is None:
        return None
    if kernel == "gluon":
        if not _whole(block_n) or block_n not in GLUON_BLOCK_N:   # 64.0 would reach the kernel's constexprs
            raise SpecError(f"block_n={block_n!r} must be an integer, 32 or 64, for the register-operand kernel; "
                            "use one of those or kernel='triton' (--kernel triton)")
        return int(block_n)
    return check_int("block_n", block_n, *BLOCK_N, power_of_two=True, what="tokens per tile, e.g. 32 or 64")


def check_num_warps(num_warps) -> int | None:
    if num_warps is None:
        return None
    return check_int("num_warps", num_warps, *NUM_WARPS, power_of_two=True,
                     what="warps per program, e.g. 4 or 8; 32 warps are 1024 threads, the CUDA maximum")


def check_num_stages(num_stages) -> int | None:
    if num_stages is None:
        return None
    return check_int("num_stages", num_stages, *NUM_STAGES, what="Triton pipeline stages, e.g. 2")


def check_stages(stages) -> int | None:
    """Code tiles in flight of the register-operand kernel."""
    if stages is None:
        return None
    if not _whole(stages) or stages not in GLUON_STAGES:   # 3.0 would reach the kernel's constexprs
        raise SpecError(f"stages={stages!r} must be an integer, 2, 3 or 4 (code tiles in flight of "
                        "the register-operand kernel)")
    return int(stages)


def check_splits(splits) -> int | None:
    if splits is None:
        return None
    return check_int("splits", splits, 1, what="split-KV count, or None for automatic")


def check_choice(name: str, value, choices: tuple):
    if isinstance(value, bool) or value not in choices:
        raise SpecError(f"{name}={value!r} is not one of {choices}")
    return value


def check_kernel(kernel) -> str:
    return check_choice("kernel", kernel, KERNELS)


def check_gemm_options(**options) -> dict:
    """The GEMM kernel's launch options (None: `launch_config`'s choice); the validated ones set."""
    unknown = sorted(set(options) - set(GEMM_LAUNCH))
    if unknown:
        raise SpecError(f"unknown GEMM launch option(s) {unknown}; they are {', '.join(GEMM_LAUNCH)}")
    checks = {"block_m": lambda v: check_int("block_m", v, *GEMM_TILE, power_of_two=True, what="rows per tile"),
              "block_n": lambda v: check_int("block_n", v, *GEMM_TILE, power_of_two=True, what="columns per tile"),
              "block_k": lambda v: check_int("block_k", v, *GEMM_TILE, power_of_two=True, what="k per step"),
              "split_k": lambda v: check_int("split_k", v, *SPLIT_K, what="programs sharing the k axis"),
              "num_warps": check_num_warps, "num_stages": check_num_stages}
    return {k: checks[k](v) for k, v in options.items() if v is not None}


def check_launch_options(target: str, kernel: str, **options) -> dict:
    """Validate the launch options given (None: unset) for ``kernel`` ("triton", "gluon" or
    "gemm") on ``target``; return those set. An option the kernel or target does not use is an
    error naming it (and its CLI flag), never ignored."""
    given = {k: v for k, v in options.items() if v is not None}
    if target == "reference":
        if given:
            raise SpecError(f"{', '.join(_named(k, v) for k, v in given.items())}: target='reference' "
                            "runs the float64 executor and launches no kernel; drop the option(s) or use "
                            "target='interpret' (or a GPU target)")
        return {}
    if kernel == "gemm":
        return check_gemm_options(**given)
    if kernel == "gluon":
        if "num_warps" in given:
            raise SpecError(f"num_warps={given['num_warps']!r} (--num-warps): the register-operand kernel runs one "
                            "warp per program and takes no num_warps; drop it or pick kernel='triton' "
                            "(--kernel triton)")
        if "num_stages" in given:
            raise SpecError(f"num_stages={given['num_stages']!r}: the register-operand kernel's pipeline depth is "
                            "stages=2, 3 or 4; pass stages, or pick kernel='triton'")
        check_block_n(given.get("block_n"), "gluon")
        check_stages(given.get("stages"))
        return given
    if kernel != "triton":
        raise SpecError(f"kernel={kernel!r} is not one of ('triton', 'gluon', 'gemm')")
    check_block_n(given.get("block_n"))
    check_num_warps(given.get("num_warps"))
    check_num_stages(given.get("num_stages"))
    check_splits(given.get("splits"))
    return given


GLUON_TARGETS = ("sm_90", "sm_100")   # the register-operand kernel's (mma.sync on register operands)


def attention_kernel(spec, target: str, kernel: str = "auto", options=(), aot: bool = False,
                     dtype: str = "bf16") -> str:
    """"triton" or "gluon": the kernel that lowers attention ``spec`` for ``target`` and ``dtype``
    queries. "auto" takes the register-operand kernel on sm_90 and sm_100 (which keeps mma.sync) where
    it lowers the plan and none of ``options`` (a mapping of the options given) is one it does not
    take; "gluon" insists and says why it cannot; "triton" never. ``aot``: an ahead-of-time build
    (no GPU needed)."""
    check_kernel(kernel)
    given = {k: v for k, v in dict(options).items() if v is not None}
    if kernel == "triton":
        return "triton"
    if target not in GLUON_TARGETS:
        if kernel == "gluon":
            raise SpecError(f"kernel='gluon' runs on target='sm_90' or 'sm_100' (a GPU); this call has "
                            f"target={target!r}. Build it ahead of time with `foldc compile --kernel gluon --target "
                            "sm_90`, or use kernel='auto' or 'triton'")
        return "triton"
    ok, reason = attention_backend("gluon").lowerable(spec, dtype)
    if kernel == "gluon":
        if not ok:
            raise SpecError(f"kernel='gluon' (--kernel gluon) cannot lower this spec: {reason}; use kernel='auto' "
                            "or 'triton'")
        return "gluon"
    triton_only = {"num_warps", "num_stages", "fold_policy", "split_prescaled"}
    if not ok or set(given) & triton_only or given.get("block_n", 32) not in GLUON_BLOCK_N:
        return "triton"
    return "gluon"


def cli_launch_options(spec, target: str, kernel: str = "auto", block_n=None, num_warps=None,
                       num_stages=None, dtype: str = "bf16") -> tuple[str | None, dict]:
    """`foldc compile`'s flags --kernel, --block-n, --num-warps, --num-stages for ``spec`` on
    ``target``: (the kernel that will run, "triton", "gluon", "gemm" or None for the reference
    target; its validated options by their Python names). --num-stages is the register-operand
    kernel's ``stages``. Every flag the chosen kernel or target does not use is an error."""
    check_kernel(kernel)
    flags = {"block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
    if target == "reference":
        if kernel != "auto":
            raise SpecError(f"kernel={kernel!r} (--kernel): target='reference' runs the float64 executor, no "
                            "kernel; drop --kernel or use --target interpret")
        return None, check_launch_options("reference", "triton", **flags)
    workload = workload_of(spec)
    if workload is not None:
        return workload.cli_options(spec, target, kernel, block_n, num_warps, num_stages)
    which = attention_kernel(spec, target, kernel, {"block_n": block_n, "num_warps": num_warps}, aot=True,
                             dtype=dtype)
    if which == "triton":
        return "triton", check_launch_options(target, "triton", **flags)
    if num_stages is not None and (isinstance(num_stages, bool) or num_stages not in GLUON_STAGES):
        chosen = "--kernel auto picks" if kernel == "auto" else "--kernel gluon is"
        raise SpecError(f"num_stages={num_stages!r} (--num-stages): {chosen} the register-operand kernel for this "
                        f"layout on {target}, which keeps 2, 3 or 4 code tiles in flight; use one of those or "
                        "--kernel triton")
    return "gluon", check_launch_options(target, "gluon", block_n=block_n, num_warps=num_warps, stages=num_stages)


def check_out_dir(out, name: str = "out") -> Path:
    """Create folder ``out`` (and its parents) and make sure a file can be written in it."""
    if out is None or str(out) == "":
        raise SpecError(f"{name}={out!r}: give a folder to write the kernel into (--out DIR)")
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise SpecError(f"{name}={str(out)!r} is not a writable folder ({e.strerror or e}); give --out a folder "
                        "you can write") from None
    if not os.access(path, os.W_OK):
        raise SpecError(f"{name}={str(out)!r} is not writable; give --out a folder you can write")
    return path


def cli_out_dir(ap, out) -> Path:
    """`check_out_dir` for a command's --out, before it runs anything: a usage error (exit 2) naming the
    folder, not a traceback from its first write (the benchmarks' mkdir)."""
    try:
        return check_out_dir(out)
    except SpecError as e:
        ap.error(str(e))


def cli_items(ap, flag: str, text) -> list[str] | None:
    """The items of a comma-separated flag (None: the flag left out); a usage error (exit 2) where it holds none: an
    empty value (an unset shell variable, ``--only "$LAYOUT"``) was taken for the flag left out, its default run."""
    if text is None:
        return None
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        ap.error(f"{flag}={text!r} is empty: give at least one comma-separated item, or leave the flag out for its "
                 "default")
    return items


def check_count(name: str, value, high: int, what: str = "") -> int:
    """A positive int up to ``high`` (a CLI count: --batch, --tokens...)."""
    return check_int(name, value, 1, high, what=what)
