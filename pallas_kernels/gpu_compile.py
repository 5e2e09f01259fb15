"""Compile Pallas (Triton) kernels for an NVIDIA GPU on a machine WITHOUT one: lowering -> Triton
IR -> XLA's Triton pipeline -> PTX -> `ptxas -v` (registers, spills).

Every jax-internal hook the compile check needs lives in this one module. Needs the `gpu-compile`
extra (`jax-cuda12-plugin`, whose PJRT plugin carries XLA's Triton pipeline, and
`nvidia-cuda-nvcc-cu12` for `ptxas`); `missing()` says what is absent.

Checked on jax/jaxlib 0.10.2 (the newest release the project's registry carries). The hooks:
- `jax_plugins.xla_cuda12` (the plugin's loader): `_import_extensions`, `_get_library_path`, and
  `cuda_plugin_extension.compile_triton_to_asm(c_api, ir, arch, warps, ctas, stages)`. With no
  CUDA runtime, the plugin's own `initialize()` fails its version check (it logs a traceback
  unless `JAX_PLATFORMS=cpu`) before registering its Triton compilation handler, so we load the
  PJRT library ourselves (`xla_client.load_pjrt_plugin_dynamically`) and call the extension.
- `jax._src.lib.triton` (`has_compilation_handler`, `compile`): the handler registry.
- jaxlib <= 0.10.2: the `pallas_call` lowering emits a `__gpu$xla.gpu.triton` custom call whose
  `mhlo.backend_config` holds the Triton IR bytecode (`ir`), `num_warps`, `num_stages`,
  `grid_x/y/z`; we read those from the StableHLO module.
- jaxlib > 0.10.2 compiles during lowering (`triton.compile` in
  `jax._src.pallas.triton.pallas_call_registration`) and refuses to lower when no GPU is visible
  unless an abstract mesh with a CUDA abstract device is in scope; we lower under
  `jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=...))` (harmless on
  0.10.2) and capture every `triton.compile` call. That branch follows the upstream code; it has
  not been run here (no such jaxlib on the registry yet).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    from jax._src.lib.triton import CompilationHandler, CompilationResult

__all__ = [
    "PtxasInfo",
    "TritonKernel",
    "compile_to_ptx",
    "lower_for_cuda",
    "lower_triton_kernels",
    "missing",
    "needs_plugin_to_lower",
    "ptxas",
]

_TRITON_TARGET = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One `pallas_call` of a lowered function: its Triton IR and launch parameters."""

    name: str
    ir: bytes
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    ptx: str | None = None  # set when the lowering already compiled it (jaxlib > 0.10.2)
    smem_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class PtxasInfo:
    """What `ptxas -v` says about one kernel."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    log: str


def _jaxlib_version() -> tuple[int, ...]:
    from jax._src.lib import version

    return tuple(version)


def _ptxas_path() -> str | None:
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except ImportError:
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "bin", "ptxas")
        if os.access(path, os.X_OK):
            return path
    return shutil.which("ptxas")


def missing() -> str | None:
    """None if everything the compile check needs is installed, else what is missing."""
    try:
        plugin = importlib.util.find_spec("jax_plugins.xla_cuda12")
    except ImportError:  # no jax_plugins namespace at all
        plugin = None
    if plugin is None:
        return (
            "jax-cuda12-plugin is not installed (pip install -e '.[gpu-compile]'): it carries "
            "XLA's Triton pipeline"
        )
    try:
        from importlib.metadata import version

        from jax._src.lib import version_str as jaxlib_version

        if version("jax-cuda12-plugin") != jaxlib_version:
            return f"jax-cuda12-plugin {version('jax-cuda12-plugin')} does not match jaxlib {jaxlib_version}"
    except Exception:  # metadata missing (e.g. a source tree on PYTHONPATH): try it anyway
        pass
    if _ptxas_path() is None:
        return "ptxas not found (pip install -e '.[gpu-compile]' installs nvidia-cuda-nvcc-cu12)"
    return None


@functools.cache
def _compile_handler() -> CompilationHandler:
    """(ir, arch, num_warps, num_ctas, num_stages) -> result with `.asm` (PTX), `.smem_bytes`."""
    from jax._src.lib import triton, xla_client

    if triton.has_compilation_handler("CUDA"):  # the plugin initialised (JAX_PLATFORMS=cpu or GPU)

        def registered(
            module: bytes, arch_name: str, num_warps: int, num_ctas: int, num_stages: int
        ) -> CompilationResult:
            # triton.compile takes the launch parameters by keyword only
            return triton.compile(
                "CUDA", module, arch_name, num_warps=num_warps, num_ctas=num_ctas, num_stages=num_stages
            )

        return registered
    from jax_plugins import xla_cuda12

    xla_cuda12._import_extensions()
    ext = xla_cuda12.cuda_plugin_extension
    if ext is None:
        raise RuntimeError("jax-cuda12-plugin's cuda_plugin_extension could not be imported")
    c_api = xla_client.load_pjrt_plugin_dynamically("cuda", str(xla_cuda12._get_library_path()))

    def handler(
        module: bytes, arch_name: str, num_warps: int, num_ctas: int, num_stages: int
    ) -> CompilationResult:
        result: CompilationResult = ext.compile_triton_to_asm(
            c_api, module, arch_name, num_warps, num_ctas, num_stages
        )
        return result

    if _jaxlib_version() > (0, 10, 2):  # the lowering itself needs it from here on
        triton.register_compilation_handler("CUDA", handler)
    return handler


def compile_to_ptx(kernel: TritonKernel, arch: str = "9.0") -> tuple[str, int]:
    """Run XLA's Triton pipeline on the kernel's IR for compute capability `arch` ("9.0" -> the
    sm_90a target). Returns (PTX text, shared memory bytes Triton allocates per program)."""
    if kernel.ptx is not None:
        return kernel.ptx, int(kernel.smem_bytes or 0)
    res = _compile_handler()(kernel.ir, arch, kernel.num_warps, 1, kernel.num_stages)
    return res.asm, int(res.smem_bytes)


def ptxas(ptx: str, gpu_name: str = "sm_90a") -> PtxasInfo:
    """Assemble PTX with `ptxas -v`; raises RuntimeError with ptxas's message if it fails."""
    exe = _ptxas_path()
    if exe is None:
        raise RuntimeError(missing() or "ptxas not found")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run(
            [exe, "-v", f"--gpu-name={gpu_name}", src, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
        )
    log = proc.stdout + proc.stderr
    if proc.returncode:
        raise RuntimeError(f"ptxas failed ({proc.returncode}):\n{log}")

    def num(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return PtxasInfo(
        registers=num(r"Used (\d+) registers"),
        spill_stores=num(r"(\d+) bytes spill stores"),
        spill_loads=num(r"(\d+) bytes spill loads"),
        stack_bytes=num(r"(\d+) bytes stack frame"),
        log=log,
    )


@contextlib.contextmanager
def _cuda_abstract_mesh() -> Iterator[None]:
    sharding = jax.sharding
    if not hasattr(sharding, "use_abstract_mesh") or not hasattr(sharding, "AbstractDevice"):
        yield
        return
    device = sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    with sharding.use_abstract_mesh(sharding.AbstractMesh((), (), abstract_device=device)):
        yield


def needs_plugin_to_lower() -> bool:
    """jaxlib > 0.10.2 compiles Triton kernels while lowering, so even a lowering-only check
    needs the CUDA plugin's Triton compilation handler."""
    return _jaxlib_version() > (0, 10, 2)


def lower_for_cuda(fn: Callable[..., Any], *shapes: jax.ShapeDtypeStruct) -> Any:
    """`jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))` on a machine with no GPU
    (under a CUDA abstract mesh; on jaxlib > 0.10.2 with the plugin's compile handler)."""
    if needs_plugin_to_lower():
        _compile_handler()
    with _cuda_abstract_mesh():
        return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))


def _custom_calls(module: Any) -> Iterator[Any]:
    for region in module.regions:
        for block in region.blocks:
            for op in block.operations:
                if op.operation.name == "stablehlo.custom_call":
                    yield op
                yield from _custom_calls(op.operation)


def lower_triton_kernels(fn: Callable[..., Any], *shapes: jax.ShapeDtypeStruct) -> list[TritonKernel]:
    """Lower `jax.jit(fn)` at `shapes` for CUDA and return its Pallas Triton kernels."""
    from jax._src.lib.mlir import ir

    if not needs_plugin_to_lower():
        lowered = lower_for_cuda(fn, *shapes)
        out = []
        for op in _custom_calls(lowered.compiler_ir("stablehlo").operation):
            if ir.StringAttr(op.attributes["call_target_name"]).value != _TRITON_TARGET:
                continue
            cfg = op.attributes["mhlo.backend_config"]

            def i32(key: str, cfg: Any = cfg) -> int:
                return int(ir.IntegerAttr(cfg[key]).value)

            out.append(
                TritonKernel(
                    name=ir.StringAttr(cfg["name"]).value,
                    ir=ir.StringAttr(cfg["ir"]).value_bytes,
                    num_warps=i32("num_warps"),
                    num_stages=i32("num_stages"),
                    grid=(i32("grid_x"), i32("grid_y"), i32("grid_z")),
                )
            )
        return out
    return _lower_capturing_compiles(jax.jit(fn), shapes)


def _lower_capturing_compiles(jitted: Any, shapes: tuple[Any, ...]) -> list[TritonKernel]:
    """jaxlib > 0.10.2: the lowering calls `triton.compile` per pallas_call; record each call.
    Grids come from the pallas_call equations, in the same (trace) order."""
    from jax._src.lib import triton

    _compile_handler()  # registers the handler if the plugin could not
    traced = jitted.trace(*shapes)
    calls = [eqn.params for eqn in _pallas_eqns(traced.jaxpr.jaxpr)]
    captured: list[tuple[Any, ...]] = []
    real = triton.compile

    def spy(
        platform: str, module: bytes, arch_name: str, *, num_warps: int, num_ctas: int, num_stages: int
    ) -> CompilationResult:
        res = real(platform, module, arch_name, num_warps=num_warps, num_ctas=num_ctas, num_stages=num_stages)
        captured.append((module, num_warps, num_stages, res))
        return res

    triton.compile = spy
    try:
        with _cuda_abstract_mesh():
            traced.lower(lowering_platforms=("cuda",))
    finally:
        triton.compile = real
    out = []
    for params, (module, warps, stages, res) in zip(calls, captured, strict=True):
        grid = tuple(params["grid_mapping"].grid) + (1,) * (3 - len(params["grid_mapping"].grid))
        out.append(
            TritonKernel(
                name=str(params.get("name") or "pallas_call"),
                ir=module,
                num_warps=warps,
                num_stages=stages,
                grid=grid,
                ptx=res.asm,
                smem_bytes=int(res.smem_bytes),
            )
        )
    return out


def _pallas_eqns(jaxpr: Any) -> Iterator[Any]:
    """pallas_call equations in trace order, descending into sub-jaxprs (pjit, cond, ...)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
            continue
        for val in eqn.params.values():
            for sub in val if isinstance(val, tuple | list) else (val,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    yield from _pallas_eqns(sub)
