"""Shared plumbing for the Triton ops: dispatch rule, lazily built kernels and device functions,
input checks.

Dispatch rule (docs/structures.md, "Dispatch of ops"): an op runs its Triton kernel on CUDA
tensors, and on CPU tensors when the environment variable ``TRITON_INTERPRET`` is ``"1"`` at
call time (Triton's interpreter, used by the tests); it runs its torch reference otherwise,
whenever autograd is recording gradients for one of its inputs, and while ``torch.compile``
traces it (so the compiler sees plain torch math).

Triton decorates its own library functions (``tl.sum``, ...) when ``triton`` is first imported,
so the interpreter only works if ``TRITON_INTERPRET=1`` was set before that import;
:func:`interpreter_available` tells whether it was.
"""

import functools
import os
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # triton is optional off Linux; every op then runs its torch reference
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False


def _fix_interpreter_index() -> bool:
    """Backport of triton-lang/triton#9172 to an older interpreter; True when it was applied.

    Triton's interpreter holds every runtime scalar (a program id, an int argument, ...) as a
    1-element numpy array and converts one to a Python int, for ``range(lo, hi, step)`` over
    runtime bounds, with ``int(data)``: NumPy >= 2.4 raises ``TypeError: only 0-dimensional arrays
    can be converted to Python scalars`` there (issue triton-lang/triton#9171; Triton 3.6's
    interpreter, fixed upstream as ``int(data.squeeze())``, as Triton 3.9 has it). Every kernel
    with a loop over runtime bounds failed under such an interpreter. This wraps the interpreter's
    ``_patch_lang_tensor`` to install the fixed ``__index__`` instead, only where its source still
    has the old conversion (an interpreter written otherwise is left as it is) and only when the
    interpreter is loaded (triton imported with ``TRITON_INTERPRET=1``; compiled kernels never use it).
    """
    import inspect
    import sys
    interp = sys.modules.get("triton.runtime.interpreter")
    orig = getattr(interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_mtpspec_index_fix", False):
        return False
    try:
        src = inspect.getsource(orig)
    except (OSError, TypeError):
        return False
    if 'scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))' not in src:
        return False

    def _patch_lang_tensor(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._mtpspec_index_fix = True  # type: ignore[attr-defined]
    interp._patch_lang_tensor = _patch_lang_tensor
    return True


if HAS_TRITON:
    _fix_interpreter_index()

#: Activation dtypes the kernels accept.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Longest row (elements) a row-norm kernel keeps whole in registers; longer rows loop.
MAX_FUSED_HIDDEN = 16384
#: Column block of a looping row-norm kernel.
LOOP_BLOCK_N = 4096
#: Up to this many rows a row-norm launch is latency-bound (decode and draft steps).
DECODE_ROWS = 64
#: Elements per program when rows are short (a program then takes several rows).
ROWS_TARGET_ELEMS = 2048


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` is ``"1"`` now (Triton kernels then run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_available() -> bool:
    """True when Triton was imported with ``TRITON_INTERPRET=1``, so interpreted kernels can run.

    Triton's library functions (``tl.sum``, ``tl.max``, ...) are built as interpreted or compiled
    functions once, at import; an interpreted kernel calling a compiled one fails.
    """
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(tl.standard.sum, InterpretedFunction)


def use_triton(t: torch.Tensor, *others: Optional[torch.Tensor]) -> bool:
    """Whether an op on ``t`` (and ``others``, ``None`` entries ignored) runs its Triton kernel.

    True on CUDA tensors, and on CPU tensors while ``TRITON_INTERPRET == "1"``; False when Triton
    is not installed, while ``torch.compile`` traces, and when ``torch.is_grad_enabled()`` and any
    of the tensors requires grad (the torch references are differentiable, the kernels are not).
    """
    if not HAS_TRITON:
        return False
    if torch.is_grad_enabled() and any(o is not None and o.requires_grad for o in (t, *others)):
        return False
    if torch.compiler.is_compiling():
        return False
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and interpreting()


_PDL: List[bool] = []


def pdl_enabled() -> bool:
    """Whether kernels built with ``LazyKernel(fn, pdl=True)`` launch as programmatic dependent
    launches (CUDA's PDL: the kernel may start while the one before it in the stream finishes, and
    waits for it with ``griddepcontrol.wait`` before reading its inputs): a CUDA (not ROCm) device
    of compute capability >= 9.0, unless ``MTPSPEC_PDL=0``. Decided once per process, on the
    current device of the first launch (a process drives one GPU: one rank)."""
    if not _PDL:
        on = os.environ.get("MTPSPEC_PDL", "1") != "0" and torch.cuda.is_available() and torch.version.hip is None
        _PDL.append(bool(on) and torch.cuda.get_device_capability(torch.cuda.current_device()) >= (9, 0))
    return _PDL[0]


class LazyKernel:
    """A Triton kernel built on first launch, per mode: interpreted while ``TRITON_INTERPRET`` is
    ``"1"`` at launch, compiled (``triton.JITFunction``) otherwise. Launch as ``kernel[grid](...)``.

    ``pdl=True``: the kernel has a last parameter ``PDL: tl.constexpr`` and begins with
    :func:`~mtpspec.ops.triton_helpers.pdl_begin`; each launch passes ``PDL`` (and Triton's
    ``launch_pdl``) as :func:`pdl_enabled` says, compiled kernels only.

    Building at launch rather than at import makes the dispatch rule hold whatever the order in
    which modules were imported and the variable was set.
    """

    def __init__(self, fn: Callable[..., None], pdl: bool = False) -> None:
        self.fn = fn
        self.pdl = pdl
        self._built: Dict[bool, Any] = {}

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., None]:
        mode = interpreting()
        kernel = self._built.get(mode)
        if kernel is None:
            kernel = self._built[mode] = self._build(mode)
        launch = kernel[tuple(grid)]
        if not self.pdl:
            return launch
        if not mode and pdl_enabled():
            return functools.partial(launch, PDL=True, launch_pdl=True)
        return functools.partial(launch, PDL=False)

    def _build(self, interpret: bool) -> Any:
        if not HAS_TRITON:
            raise RuntimeError(f"{self.fn.__name__}: Triton is not installed")
        if interpret:
            if not interpreter_available():
                raise RuntimeError(
                    f"{self.fn.__name__}: TRITON_INTERPRET=1 was set after triton was imported; "
                    "set it before the first `import triton` (e.g. in the environment)")
            from triton.runtime.interpreter import InterpretedFunction
            return InterpretedFunction(self.fn)
        return triton.JITFunction(self.fn)


if HAS_TRITON:
    class DeviceFunction(triton.JITFunction):
        """A Triton device function (a helper that kernels call) for both launch modes: a
        ``triton.JITFunction``, so a compiled kernel inlines it exactly as an ``@triton.jit``
        helper, and callable from a kernel running under the interpreter, whatever
        ``TRITON_INTERPRET`` was when its module was imported. Made by :func:`device_function`.
        """

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            # Reached only from an interpreted kernel (a compiled kernel inlines the function
            # while compiling and never calls it): run it as an interpreted device function.
            interpreted = self.__dict__.get("_interpreted")
            if interpreted is None:
                from triton.runtime.interpreter import InterpretedFunction
                interpreted = self.__dict__["_interpreted"] = InterpretedFunction(self.fn)
            return interpreted(*args, **kwargs)


#: Per device: the int32 counters of :func:`arrival_counters` (zero between launches).
_ARRIVAL_COUNTERS: Dict[Any, torch.Tensor] = {}
_RETIRED_COUNTERS: List[torch.Tensor] = []


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 counters on ``device``, all zero: the counters of
    :func:`~mtpspec.ops.triton_helpers.last_to_arrive`, shared by every kernel that uses them
    (each launch leaves the ones it used at zero again). One buffer per device, made (zeroed) on
    first use and grown when a launch needs more; the kernels that share it must run in stream
    order, one after another, as the engine runs them (one compute stream per device).
    Allocate before a CUDA-graph capture (the warm-up call does) so the capture records no fill."""
    key = (device.type, device.index if device.index is not None or device.type != "cuda"
           else torch.cuda.current_device())
    buf = _ARRIVAL_COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"arrival_counters: {n} counters needed on {device} during a CUDA-graph capture "
                               "(the zero fill would only be recorded); make the same call once before capturing")
        if buf is not None:  # graphs captured with it still use it: never free it
            _RETIRED_COUNTERS.append(buf)
        buf = _ARRIVAL_COUNTERS[key] = torch.zeros(max(4096, 2 * n), dtype=torch.int32, device=device)
    return buf


def device_function(fn: Callable[..., Any]) -> Any:
    """Decorate a Triton helper that kernels call (the counterpart of :class:`LazyKernel` for
    device functions): compiled kernels inline it like any ``@triton.jit`` function, interpreted
    kernels run it interpreted. Without Triton, ``fn`` is returned unchanged (never called)."""
    return DeviceFunction(fn) if HAS_TRITON else fn


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints ``a >= 0``, ``b > 0``."""
    return -(-a // b)


def num_warps_for(block_elems: int, elem_bytes: int) -> int:
    """Warps for a program holding ``block_elems`` elements of ``elem_bytes`` each: about four
    16-byte vectors per thread and tensor, a power of two in [1, 16]."""
    warps = (block_elems * elem_bytes) // (32 * 16 * 4)
    return max(1, min(16, next_power_of_2(max(1, warps))))


class RowLaunch(NamedTuple):
    """Launch shape of a row-wise kernel: ``block_m`` rows x ``block_n`` columns per program."""
    block_m: int
    block_n: int
    one_pass: bool
    num_warps: int
    grid_rows: int


def row_launch(n_rows: int, n_cols: int, elem_bytes: int) -> RowLaunch:
    """Block sizes for normalising ``n_rows`` rows of ``n_cols`` elements.

    A row of up to ``MAX_FUSED_HIDDEN`` elements is one block (``one_pass``: it stays in
    registers; short rows are packed ``block_m`` to a program); longer rows loop over blocks of
    ``LOOP_BLOCK_N`` columns, one row per program.
    """
    block_n = next_power_of_2(n_cols)
    if block_n <= MAX_FUSED_HIDDEN:
        block_m = min(64, max(1, ROWS_TARGET_ELEMS // block_n), next_power_of_2(n_rows))
        one_pass = True
    else:
        block_m, block_n, one_pass = 1, LOOP_BLOCK_N, False
    warps = num_warps_for(block_m * block_n, elem_bytes)
    if one_pass and n_rows <= DECODE_ROWS:
        # Decode sizes are pure latency: 4 warps measured fastest or within 3% of the fastest at
        # hidden 6144 / 7168 x 1, 4, 64 rows on the H200 (benchmarks/sweep_norm_warps.py), and
        # 11% faster than 8 at 6144 x 1 (2.06 vs 2.31 us; torch.compile 2.10).
        warps = min(warps, 4)
    return RowLaunch(block_m, block_n, one_pass, warps, cdiv(n_rows, block_m))


def check_float_dtype(t: torch.Tensor, name: str) -> None:
    """Raise ``TypeError`` unless ``t`` is fp16, bf16 or fp32."""
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def check_eps(eps: float, positive: bool) -> None:
    """Raise ``ValueError`` unless ``eps`` is a finite number, > 0 when ``positive`` else >= 0.

    With ``eps > 0`` the RMSNorm of a zero row (a padding row, a masked embedding) is 0, not NaN.
    """
    ok = isinstance(eps, (int, float)) and not isinstance(eps, bool)
    ok = ok and 0.0 <= float(eps) < float("inf") and not (positive and float(eps) == 0.0)
    if not ok:
        raise ValueError(f"eps must be a finite number {'> 0' if positive else '>= 0'}, "
                         f"got {eps!r}")


def check_device(t: torch.Tensor, name: str, like: torch.Tensor, like_name: str) -> None:
    """Raise ``ValueError`` unless ``t`` is on ``like``'s device."""
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but {like_name} is on {like.device}; "
                         "put them on the same device")


def check_weight(weight: torch.Tensor, name: str, hidden_size: int, like: torch.Tensor,
                 like_name: str) -> None:
    """Raise unless ``weight`` is a float tensor of shape ``[hidden_size]`` with unit stride on
    ``like``'s device (``ValueError`` for shape/stride/device, ``TypeError`` for dtype)."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
    if tuple(weight.shape) != (hidden_size,):
        raise ValueError(f"{name} must have shape [hidden_size] = [{hidden_size}], "
                         f"got {list(weight.shape)}")
    check_float_dtype(weight, name)
    check_device(weight, name, like, like_name)
    if hidden_size > 1 and weight.stride(0) != 1:
        raise ValueError(f"{name} must have unit stride, got strides {tuple(weight.stride())}")


def check_tensor_args(op: str, like_name: str, like: torch.Tensor,
                      named: Sequence[tuple]) -> None:
    """Each ``(name, t)`` of ``named`` must be a torch.Tensor on ``like``'s device.

    Raises:
        TypeError: a non-tensor argument; ValueError: a tensor on another device (both name ``op``).
    """
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != like.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {like_name} is on {like.device}")


def check_paged_metadata(op: str, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                         block_tables: torch.Tensor, max_query_len: int) -> None:
    """Shapes, dtypes and strides of the paged-attention metadata: ``query_start_loc [B + 1]``,
    ``seq_lens [B]``, ``block_tables [B, max_blocks]`` (int32 / int64, unit row stride),
    ``max_query_len`` an int >= 0.

    Raises:
        ValueError: a wrong shape, stride or ``max_query_len``; TypeError: a wrong dtype (both name ``op``).
    """
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1:
        raise ValueError(f"{op}: query_start_loc must be [num_seqs + 1], got {list(query_start_loc.shape)}")
    b = query_start_loc.shape[0] - 1
    if seq_lens.shape != (b,):
        raise ValueError(f"{op}: seq_lens must be [num_seqs] = [{b}], got {list(seq_lens.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError(f"{op}: block_tables must be [num_seqs={b}, max_blocks], got "
                         f"{list(block_tables.shape)}")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{op}: {name} must be int32 or int64, got {t.dtype}")
    if block_tables.shape[1] and block_tables.stride(1) != 1:
        raise ValueError(f"{op}: block_tables rows need unit stride")
    if not isinstance(max_query_len, int) or isinstance(max_query_len, bool) or max_query_len < 0:
        raise ValueError(f"{op}: max_query_len must be an int >= 0, got {max_query_len!r}")


def as_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """View ``t`` (``[..., hidden_size]``, at least 1-D) as ``[num_tokens, hidden_size]`` without
    copying. Rows may have any stride (offset views and column slices work); the last dimension
    must have unit stride and leading dimensions must flatten into one.

    Raises ``TypeError`` if ``t`` is not a tensor, ``ValueError`` (naming ``name`` and its
    strides) otherwise.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 0:
        raise ValueError(f"{name} must be [num_tokens, hidden_size], got a 0-d tensor")
    hidden = t.shape[-1]
    if hidden == 0:
        raise ValueError(f"{name} has hidden_size 0; expected [num_tokens, hidden_size > 0]")
    if hidden > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got shape "
                         f"{list(t.shape)} strides {tuple(t.stride())}; pass {name}.contiguous()")
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, hidden)
    except RuntimeError:
        raise ValueError(f"{name} of shape {list(t.shape)} strides {tuple(t.stride())} cannot be "
                         f"viewed as [num_tokens, hidden_size]; pass {name}.contiguous()") from None



def compile_reports(specs: Sequence[Dict[str, Any]], arch: int = 90, ptxas: bool = False) -> List[Dict[str, Any]]:
    """Compile kernels ahead of time for ``sm_<arch>`` (no GPU needed) and summarise the code.

    Each spec: ``{"module": "mtpspec.ops.rms_norm", "kernel": "_kernel", "signature": {arg:
    Triton type such as "*bf16", "i32", "fp32"}, "constexprs": {...}, "aligned": [args Triton
    would specialise as divisible by 16 at launch: 16-byte-aligned pointers, multiples of 16],
    "num_warps": n}`` (optional ``"num_stages"``: Triton's default otherwise). Compiles in a fresh
    Python process without ``TRITON_INTERPRET`` (as a GPU process would). Returns per spec
    ``{"ptx_vec4_loads", "ptx_loads", "ptx_vec4_stores", "ptx_stores", "ptx_bulk_tensor_loads",
    "ptx_shared_byte_loads", "ptx_griddepcontrol", "shared_bytes", "registers", "spill_bytes"}`` (counts of PTX
    instructions; the shared memory a program allocates; the last two None without ``cuobjdump``); ``ptxas=True`` adds ``{"ptxas_registers", "spill_stores",
    "spill_loads"}`` (bytes per thread) from the bundled ``ptxas -v --gpu-name sm_<arch>a`` run on
    the PTX (None without ``ptxas``).
    Diagnostics for tests and tuning.

    Raises ``RuntimeError`` with the child's output if compilation fails.
    """
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    code = ("import json, sys\nfrom mtpspec.ops.triton_utils import _compile_report\n"
            "print(json.dumps([_compile_report(s, int(sys.argv[2]), sys.argv[3] == '1') "
            "for s in json.loads(sys.argv[1])]))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(list(specs)), str(arch), str(int(ptxas))],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ahead-of-time compile failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _compile_report(spec: Dict[str, Any], arch: int, ptxas: bool = False) -> Dict[str, Any]:
    import importlib
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(spec["module"]), spec.get("kernel", "_kernel"))
    jit = triton.JITFunction(kernel.fn)
    names = [p.name for p in jit.params]
    sig = dict(spec["signature"])
    constexprs = dict(spec["constexprs"])
    if "PDL" in names:  # a LazyKernel(fn, pdl=True) kernel: without PDL unless the spec says
        constexprs.setdefault("PDL", False)
    sig.update({k: "constexpr" for k in constexprs})
    src = ASTSource(fn=jit, signature=sig,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in spec["aligned"]})
    options = {k: spec[k] for k in ("num_warps", "num_stages") if k in spec}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    ptx = compiled.asm["ptx"]
    report: Dict[str, Any] = {
        "ptx_vec4_loads": len(re.findall(r"ld\.global[^\n]*\.v4", ptx)),
        "ptx_loads": len(re.findall(r"ld\.global", ptx)),
        "ptx_vec4_stores": len(re.findall(r"st\.global[^\n]*\.v4", ptx)),
        "ptx_stores": len(re.findall(r"st\.global", ptx)),
        "ptx_bulk_tensor_loads": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        "ptx_shared_byte_loads": len(re.findall(r"ld\.shared\.(?:[us]8|b8)", ptx)),
        "ptx_griddepcontrol": len(re.findall(r"griddepcontrol\.", ptx)),
        "shared_bytes": getattr(compiled.metadata, "shared", None), "registers": None, "spill_bytes": None}
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cubin = compiled.asm.get("cubin")
    if cubin and os.path.exists(tool):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True,
                                   text=True).stdout
        regs, stack = re.findall(r"REG:(\d+)", usage), re.findall(r"STACK:(\d+)", usage)
        report["registers"] = int(regs[0]) if regs else None
        report["spill_bytes"] = int(stack[0]) if stack else None
    if ptxas:
        report.update(_ptxas_usage(ptx, arch))
    return report


def _ptxas_usage(ptx: str, arch: int) -> Dict[str, Optional[int]]:
    """Registers and spill stores / loads (bytes per thread) that ``ptxas -v`` reports for ``ptx``
    on ``sm_<arch>a`` (the ptxas Triton itself picks for ``arch``: Triton 3.9 bundles a newer
    ``ptxas-blackwell`` for its PTX 9.x, 3.6 plain ``ptxas``; Triton's own flags aside, -O3);
    Nones without the tool or when it fails."""
    import re
    import subprocess
    import tempfile

    usage: Dict[str, Optional[int]] = {"ptxas_registers": None, "spill_stores": None, "spill_loads": None}
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        tool = get_ptxas(arch).path
    except Exception:  # other Triton versions: the bundled ptxas
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not tool or not os.path.exists(tool):
        return usage
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run([tool, "-v", f"--gpu-name=sm_{arch}a", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    usage["ptxas_registers"] = int(regs[-1]) if regs else None
    if spills:
        usage["spill_stores"], usage["spill_loads"] = int(spills[-1][0]), int(spills[-1][1])
    return usage
