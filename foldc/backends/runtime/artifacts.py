"""Ahead-of-time builds, for every backend: the artifacts a build writes and the error a failed
build raises."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from ...errors import SpecError


def write_artifacts(out_dir, name: str, arch: str, compiled, source: str | None = None) -> Path:
    """Write ``name``.py (the generated source, if any) and its TTIR/TTGIR/LLIR/PTX/cubin for
    ``arch`` into ``out_dir``; return the cubin's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if source is not None:
        (out / f"{name}.py").write_text(source)
    for ext in ("ttir", "ttgir", "llir", "ptx"):
        if ext in compiled.asm:
            (out / f"{name}.{arch}.{ext}").write_text(compiled.asm[ext])
    cubin = out / f"{name}.{arch}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    return cubin


@contextmanager
def build_errors(what: str):
    """Turn a failure of triton.compile (a CompilationError, an MLIR pass or ptxas failing on tile
    sizes it cannot fit) into a SpecError naming the build and its options."""
    from triton.compiler.errors import CompilationError

    try:
        yield
    except (CompilationError, RuntimeError, AssertionError, ValueError, IndexError) as e:
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise SpecError(f"{what} did not compile: {type(e).__name__}: {first[:300]}; use the default launch "
                        "options or smaller tiles") from None
