"""Where kernels and workloads plug into the core.

The core (spec, options, plan, proof, explain, compile) knows attention; it imports no backend and no
other workload. A backend registers an `AttentionBackend` (foldc/backends/gluon/__init__.py,
foldc/backends/triton/__init__.py) and a workload other than attention registers a `Workload`
(foldc/gemm/__init__.py); ``import foldc`` imports both packages, so the entries are in place before
any call. The core looks them up by name (`attention_backend`) or by the spec's type (`workload_of`).
This keeps the import graph one-way: core <- backends <- foldc (tests/backends/test_import_graph.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .errors import SpecError


@dataclass(frozen=True)
class AttentionBackend:
    """A lowering of the attention plan.

    ``kernel(spec, target, **options)``: the attention callable; ``target_plan(spec, dtype,
    fold_policy)``: the plan it is generated from (with its code biases and operand dtype);
    ``lowerable(spec, dtype) -> (ok, reason)``: whether it lowers ``spec`` (None: every spec);
    ``describe(spec) -> str``: a paragraph for `foldc explain` (None: nothing to add);
    ``targets``: the targets it runs on."""

    name: str
    targets: tuple[str, ...]
    kernel: Callable[..., Any]
    target_plan: Callable[..., Any]
    lowerable: Callable[..., tuple[bool, str]] | None = None
    describe: Callable[..., str] | None = None


@dataclass(frozen=True)
class Workload:
    """A reduction other than attention planned, proved and compiled by the same compiler (GEMM).

    ``spec_type``: its spec's class; ``table``: its layout file's TOML section and ``from_table(table,
    where)`` the spec read from it; ``plan(spec, code_bias, fold_policy)``, ``prove(plan)``,
    ``compile(spec, target, **options)``, ``explain(plan) -> str``, ``check_plan(plan) -> plan`` (its decisions are
    its graph's, `foldc.check_plan`); for `foldc compile`:
    ``kernel_plan(spec)`` (the plan its kernel runs), ``cli_options(spec, target, kernel, block_n,
    num_warps, num_stages) -> (kernel, options)``, ``check(spec, target, seed, callable) -> (line, ok)``
    (the interpreter or reference check), ``build(spec, target, out, dtype, **options) -> report``
    (the ahead-of-time build) and ``artifact`` (its kernel's file stem)."""

    name: str
    spec_type: type
    table: str
    from_table: Callable[..., Any]
    plan: Callable[..., Any]
    prove: Callable[..., Any]
    compile: Callable[..., Any]
    explain: Callable[..., str]
    kernel_plan: Callable[..., Any]
    cli_options: Callable[..., tuple[str, dict]]
    check: Callable[..., tuple[str, bool]]
    build: Callable[..., dict]
    artifact: str
    check_plan: Callable[..., Any]


_BACKENDS: dict[str, AttentionBackend] = {}
_WORKLOADS: dict[str, Workload] = {}


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    """Add (or replace, on a module reload) the attention backend of ``backend.name``."""
    _BACKENDS[backend.name] = backend
    return backend


def register_workload(workload: Workload) -> Workload:
    """Add (or replace) the workload of ``workload.name``."""
    _WORKLOADS[workload.name] = workload
    return workload


def attention_backend(name: str) -> AttentionBackend:
    """The registered attention backend ``name`` ("gluon" or "triton")."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise SpecError(f"no attention backend {name!r} is registered (registered: {sorted(_BACKENDS)}); "
                        "import foldc, which registers its backends, before calling into its modules") from None


def workload_of(spec) -> Workload | None:
    """The registered workload whose spec type ``spec`` is, or None (attention, or not a spec)."""
    return next((w for w in _WORKLOADS.values() if isinstance(spec, w.spec_type)), None)


def workload_of_table(section: str) -> Workload | None:
    """The registered workload whose layout files have TOML section ``section``, or None."""
    return next((w for w in _WORKLOADS.values() if w.table == section), None)


def attention_backends() -> tuple[AttentionBackend, ...]:
    return tuple(_BACKENDS.values())


def workloads() -> tuple[Workload, ...]:
    return tuple(_WORKLOADS.values())
