"""The H100 kernel contract (targets/h100/contract.py, registry.py), on the CPU.

The declarations against the sources: every `extern "C" __global__` function of every .cu file
in kernels/ (found through a small preprocessor that expands the file's own macros, so the
entries stamped out by ATTN_ENTRY, GEMM_FP8W_ENTRY, ... are seen one by one) is declared by
the module naming that source, and every declaration has its function; each parameter has the
declared name, in order, and a C type that fits the declared kind: `int` i32, `long long` i64,
`float` f32, a `...::Params` struct by value "params", a pointer "ptr" with a dtype its element
type holds (`float` float32, `int` int32, `__nv_bfloat16` bfloat16, `void` bytes, `uint8_t` and
`unsigned char` float8_e4m3fn or bytes, or any dtype where REINTERPRETED says the kernel
reinterprets them) and the role its constness says (const: "in", else "out" or "inout").

Then what the contract checks at run time: the lowering's named arguments (missing, extra,
mistyped: LoweringError naming the kernel and the parameter), a stored launch's arguments
against its entry (the reference executor), and a reference reading its inputs read-only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import pytest

from rvcompile.artifacts.kernel_schedule import (
    Arg,
    EntryPoint,
    KernelSchedule,
    KvLayout,
    Launch,
)
from rvcompile.targets.h100 import gemv_fp8, norms, registry
from rvcompile.targets.h100.contract import Call, ContractError, Entry, Param, ptr
from rvcompile.targets.h100.launches import EntryLowering
from rvcompile.targets.h100.layout import LoweringError, Ref
from rvcompile.targets.h100.nvcc import KERNEL_DIR
from rvcompile.targets.h100.reference_executor import ReferenceDevice

# ---------------------------------------------------------------- the .cu signatures

_COMMENT_OR_STRING = re.compile(r'"(?:\\.|[^"\\\n])*"|//[^\n]*|/\*.*?\*/', re.S)
_IDENT = re.compile(r"[A-Za-z_]\w*")
_DEFINE = re.compile(r"(\w+)(?:\(([^)]*)\))?\s*(.*)", re.S)
_GLOBAL = re.compile(r'extern\s+"C"\s+__global__\b')
# The C element types of pointers -> the dtypes they may hold, including attn_decode.cu's two
# type helpers as their template arguments instantiate them.
BYTES = ("float8_e4m3fn", "bytes")
POINTEE = {"float": ("float32",), "int": ("int32",), "__nv_bfloat16": ("bfloat16",),
           "void": ("bytes",), "uint8_t": BYTES, "unsigned char": BYTES,
           "Query<false>::type": ("bfloat16",), "Query<true>::type": ("float32",),
           "Elem<false,false>::type": ("bfloat16",), "Elem<true,false>::type": BYTES,
           "Elem<false,true>::type": ("float32",)}
# (source, parameter): byte pointers the kernel reads as the pool's dtype (bf16 or e4m3).
REINTERPRETED = {("attn_prefill.cu", "kc"), ("attn_prefill.cu", "vc"),
                 ("attn_prefill.cu", "base")}
SCALARS = {"int": "i32", "long long": "i64", "float": "f32"}


@dataclass(frozen=True)
class CParam:
    name: str
    base: str  # the type without const, pointer and qualifiers, spaces normalized
    pointer: bool
    const: bool


def preprocess(text: str) -> str:
    """`text` with comments removed, lines joined, the inactive branches of #ifdef / #ifndef
    dropped and every macro the file defines expanded (## pasting included)."""
    text = _COMMENT_OR_STRING.sub(lambda m: m[0] if m[0].startswith('"') else " ", text)
    macros: dict[str, tuple[list[str] | None, str]] = {}
    code, active = [], [True]
    for line in text.replace("\\\n", " ").splitlines():
        d = re.match(r"\s*#\s*(\w+)\s*(.*)", line)
        if not d:
            if all(active):
                code.append(line)
            continue
        kind, rest = d[1], d[2]
        if kind in ("ifdef", "ifndef"):
            active.append((rest.split()[0] in macros) == (kind == "ifdef"))
        elif kind == "else":
            active[-1] = not active[-1]
        elif kind == "endif":
            active.pop()
        elif kind in ("if", "elif"):
            raise AssertionError(f"#{kind} {rest}: this parser evaluates #ifdef / #ifndef only")
        elif all(active) and kind == "define":
            m = _DEFINE.fullmatch(rest)
            params = None if m[2] is None else [p.strip() for p in m[2].split(",")]
            macros[m[1]] = (params, m[3])
        elif all(active) and kind == "undef":
            macros.pop(rest.split()[0], None)
    return expand("\n".join(code), macros)


def expand(text: str, macros: dict[str, tuple[list[str] | None, str]]) -> str:
    """Every use of `macros` in `text` replaced, the result rescanned (none is recursive)."""
    i, budget = 0, 100_000
    while m := _IDENT.search(text, i):
        if m[0] not in macros:
            i = m.end()
            continue
        params, body = macros[m[0]]
        end = m.end()
        if params is not None:
            j = end
            while j < len(text) and text[j].isspace():
                j += 1
            if j == len(text) or text[j] != "(":
                i = end  # a function-like macro's name without arguments
                continue
            args, end = split_args(text, j)
            assert len(args) == len(params), f"{m[0]}: {len(args)} arguments for {params}"
            values = dict(zip(params, args, strict=True))
            body = _IDENT.sub(lambda t, v=values: v.get(t[0], t[0]), body)
            body = re.sub(r"\s*##\s*", "", body)
        text = text[:m.start()] + body + text[end:]
        i = m.start()
        budget -= 1
        assert budget, "macro expansion does not end"
    return text


def split_args(text: str, open_at: int) -> tuple[list[str], int]:
    """The comma-separated arguments of the parenthesis at `open_at`, and the index after its
    closing one."""
    depth, start, args = 0, open_at + 1, []
    for k in range(open_at, len(text)):
        c = text[k]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return [*args, text[start:k].strip()], k + 1
        elif c == "," and depth == 1:
            args.append(text[start:k].strip())
            start = k + 1
    raise AssertionError("unbalanced parentheses")


def parse_param(decl: str) -> CParam:
    decl = re.sub(r"\b(__restrict__|__grid_constant__)\b", " ", decl)
    name = re.search(r"(\w+)\s*$", decl)[1]
    ctype = decl[:decl.rindex(name)]
    const = re.search(r"\bconst\b", ctype) is not None
    ctype = re.sub(r"\bconst\b", " ", ctype).strip()
    pointer = ctype.endswith("*")
    base = re.sub(r"\s*([<>,])\s*", r"\1", " ".join(ctype.rstrip("*").split()))
    return CParam(name, base, pointer, const)


def signatures(text: str) -> dict[str, list[CParam]]:
    """Each extern "C" __global__ function of a .cu source -> its parameters."""
    code = preprocess(text)
    out = {}
    for m in _GLOBAL.finditer(code):
        head = code[m.end():code.index("{", m.end())].rstrip()
        assert head.endswith(")"), head
        depth = 0
        for k in range(len(head) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(head[k], 0)
            if depth == 0:
                break
        name = re.search(r"(\w+)\s*$", head[:k])[1]
        params, depth, start = [], 0, k + 1
        for j in range(k + 1, len(head) - 1):
            depth += {"(": 1, "<": 1, ")": -1, ">": -1}.get(head[j], 0)
            if head[j] == "," and depth == 0:
                params.append(head[start:j])
                start = j + 1
        params.append(head[start:len(head) - 1])
        assert name not in out, f"{name} defined twice"
        out[name] = [parse_param(p) for p in params if p.strip()]
    return out


def mismatches(entry: Entry, c_params: list[CParam]) -> list[str]:
    """How `entry`'s declared parameters differ from the C signature's; [] when they fit."""
    if [p.name for p in entry.params] != [c.name for c in c_params]:
        return [f"{entry.name}: declared {[p.name for p in entry.params]}, the source has "
                f"{[c.name for c in c_params]}"]
    out = []
    for p, c in zip(entry.params, c_params, strict=True):
        where = f"{entry.name}.{p.name}: declared {p.kind}"
        if c.pointer:
            if c.base not in POINTEE:
                out.append(f"{where}: pointer to unknown C type {c.base!r}")
            elif p.kind != "ptr" or (p.dtype not in POINTEE[c.base]
                                     and (entry.source, p.name) not in REINTERPRETED):
                out.append(f"{where} {p.dtype}, the source takes {c.base}*")
            elif c.const != (p.role == "in"):
                out.append(f"{where} {p.role}, the source's pointer is "
                           f"{'const' if c.const else 'not const'}")
        elif c.base.endswith("::Params"):
            if p.kind != "params":
                out.append(f"{where}, the source takes the struct {c.base}")
        elif SCALARS.get(c.base) != p.kind:
            out.append(f"{where}, the source takes {c.base}")
    return out


@pytest.fixture(scope="module")
def sources() -> dict[str, dict[str, list[CParam]]]:
    return {path.name: signatures(path.read_text()) for path in sorted(KERNEL_DIR.glob("*.cu"))}


def test_every_kernel_function_is_declared_and_every_declaration_defined(sources):
    defined = {(src, name) for src, fns in sources.items() for name in fns}
    declared = {(e.source, e.name) for e in registry.ENTRIES.values()}
    assert defined - declared == set(), "functions no module declares"
    assert declared - defined == set(), "declarations with no function"
    assert len(defined) == 511  # 150 attn_decode + 4 of its K=V tensor-core entries + 1
    # combine, 100 attn_prefill + 100 of its tensor-core decode entries, 50 GEMM, ...,
    # 2 draft_concat, 4 centroid head, sample_pick_dist and spec_ratio, sha256_pieces, the 3
    # norm / gelu_mul entries quantizing their rows (_q), gemv_mma_fp8's 36 f16-row entries, the
    # 64 x 64 FP8 GEMM tile


@pytest.mark.parametrize("source", sorted(p.name for p in KERNEL_DIR.glob("*.cu")))
def test_declared_parameters_fit_the_c_signature(sources, source):
    problems = [m for name, params in sources[source].items()
                for m in mismatches(registry.ENTRIES[name], params)]
    assert problems == []


def test_the_signature_check_can_fail(sources):
    """A declaration off by a name, a dtype, a role or a kind is reported."""
    fp8 = registry.ENTRIES["gemv_fp8_rowscale"]
    c = sources["gemv_fp8.cu"]["gemv_fp8_rowscale"]
    assert mismatches(fp8, c) == []
    p = list(fp8.params)
    for i, wrong in ((1, ptr("scale", "bfloat16")), (3, ptr("y", "float32")),
                     (0, ptr("W", "float32")), (4, Param("M", "i64")), (6, Param("k", "i32"))):
        bad = replace(fp8, params=(*p[:i], wrong, *p[i + 1:]))
        assert len(mismatches(bad, c)) == 1, wrong
    assert mismatches(registry.ENTRIES["gemv_bf16"], c)  # another kernel's parameters


def test_preprocessor_expands_pasted_names_and_nested_macros():
    text = """
    // extern "C" __global__ void commented_out(int a) {}
    #define ENTRY(D, SUFFIX, T) extern "C" __global__ void \\
        __launch_bounds__(D * 2) k_d##D##SUFFIX(const T* x, int n) { body(x, n); }
    #define BOTH(D) ENTRY(D, , float) ENTRY(D, _h, __nv_bfloat16)
    BOTH(32)
    #ifndef PROBE
    extern "C" __global__ void plain(float* __restrict__ y, long long n, float c) {}
    #else
    extern "C" __global__ void probe_only(int z) {}
    #endif
    """
    got = signatures(text)
    assert sorted(got) == ["k_d32", "k_d32_h", "plain"]
    assert got["k_d32_h"] == [CParam("x", "__nv_bfloat16", True, True),
                              CParam("n", "int", False, False)]
    assert got["plain"][1:] == [CParam("n", "long long", False, False),
                                CParam("c", "float", False, False)]


# ---------------------------------------------------------------- the lowering's arguments

def _emit(kernel: str, **args):
    """EntryLowering.emit on a lowering holding nothing but its launch list."""
    lowering = SimpleNamespace(launches=[])
    EntryLowering.emit(lowering, kernel, gemv_fp8.Launch((1, 1, 1), (32, 1, 1), 0), **args)
    return lowering.launches[0]


GEMV = {"W": Ref("weights", "w"), "scale": Ref("weights", "s"), "x": Ref("act", 0),
        "y": Ref("act", 1), "M": 1, "N": 64, "K": np.int64(32)}


def test_emit_orders_named_arguments_as_the_kernel_takes_them():
    launch = _emit("gemv_fp8_rowscale", **dict(reversed(GEMV.items())))
    assert launch.module == "gemv_fp8.cu"
    assert [(a.param.name, a.value) for a in launch.args] == [
        (k, int(v) if k == "K" else v) for k, v in GEMV.items()]
    assert type(launch.args[-1].value) is int


DROP = object()


@pytest.mark.parametrize("change, message", [
    ({"M": DROP}, "missing argument 'M'"),
    ({"bias": Ref("weights", "b")}, "has no parameter 'bias'"),
    ({"scale": None}, "parameter scale (ptr): null"),
    ({"x": 3}, "parameter x (ptr): 3 is not a pointer"),
    ({"N": 64.0}, "parameter N (i32): 64.0 is not an integer"),
    ({"N": True}, "parameter N (i32): True is not an integer"),
    ({"K": 1 << 31}, "parameter K (i32): 2147483648 out of range"),
    ({"M": Ref("act", 2)}, "parameter M (i32)"),
])
def test_emit_refuses_arguments_unlike_the_entry(change, message):
    args = {k: v for k, v in {**GEMV, **change}.items() if v is not DROP}
    with pytest.raises(LoweringError, match=re.escape(message)) as e:
        _emit("gemv_fp8_rowscale", **args)
    assert "gemv_fp8_rowscale" in str(e.value)


def test_emit_checks_floats_and_null_pointers():
    args = {"x": Ref("act", 0), "w": Ref("weights", "w"), "y": Ref("act", 1), "H": 64}
    assert _emit("rmsnorm_bf16", **args, eps=1).args[-1].value == 1.0
    for bad in (float("nan"), 1e39, "1e-6"):
        with pytest.raises(LoweringError, match="rmsnorm_bf16, parameter eps"):
            _emit("rmsnorm_bf16", **args, eps=bad)
    combine = {"part_acc": Ref("act", 0), "part_ml": Ref("act", 1), "splits": 2, "d": 32,
               "out": Ref("act", 2)}
    assert _emit("attn_decode_combine", **combine, out_bf16=None).args[-1].value is None
    with pytest.raises(LoweringError, match="no H100 kernel entry 'attn_decode_d33_g1'"):
        _emit("attn_decode_d33_g1")


# ---------------------------------------------------------------- stored launches

H, ROWS = 64, 3
X, W, Y = 0, ROWS * H * 4, ROWS * H * 4 + H * 4  # arena offsets of rmsnorm_bf16's buffers
ARENA = Y + ROWS * H * 2


def _schedule(*launches: Launch) -> KernelSchedule:
    return KernelSchedule(
        arena_bytes=ARENA, weights_bytes=0, constants_offset=0, constants_bytes=0,
        io_offset=0, io_bytes=0, max_seqs=1, max_context=16, max_chunk=1, vocab_size=128,
        kv=KvLayout(16, "bfloat16", (), ()), io={}, outputs={},
        entries={"decode_1": EntryPoint("decode_1", 1, True, launches)}, cubins={})


def _rmsnorm(**change) -> Launch:
    args = {"x": Arg("x", "ptr", X), "w": Arg("w", "ptr", W), "y": Arg("y", "ptr", Y),
            "H": Arg("H", "i32", H), "eps": Arg("eps", "f32", 1e-6), **change}
    return Launch("norms.cu", "rmsnorm_bf16", (ROWS, 1, 1), (512, 1, 1), 0,
                  tuple(a for a in args.values() if a is not None))


def test_reference_device_runs_the_entry_reference_on_named_arguments():
    dev = ReferenceDevice(_schedule(_rmsnorm()), memoryview(b""), b"")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, H)).astype(np.float32)
    w = rng.standard_normal(H).astype(np.float32)
    dev.write(X, x.tobytes())
    dev.write(W, w.tobytes())
    dev.run("decode_1")
    got = np.frombuffer(dev.read(Y, ROWS * H * 2), norms.rmsnorm_bf16(x, w, 1e-6).dtype)
    assert np.array_equal(got.reshape(ROWS, H), norms.rmsnorm_bf16(x, w, 1e-6))


@pytest.mark.parametrize("launch, message", [
    (_rmsnorm(w=Arg("weight", "ptr", W)), "arguments [('x', 'ptr'), ('weight', 'ptr')"),
    (_rmsnorm(eps=None), "the entry takes"),
    (_rmsnorm(H=Arg("H", "i64", H)), "('H', 'i64')"),
    (_rmsnorm(x=Arg("x", "null", 0)), "rmsnorm_bf16: x is null; it must not be"),
    (replace(_rmsnorm(), module="rows.cu"), "rmsnorm_bf16 of rows.cu, which no kernel module"),
    (replace(_rmsnorm(), kernel="rmsnorm_f16"), "rmsnorm_f16 of norms.cu, which no kernel"),
    (replace(_rmsnorm(), module="gemm_tc.cu", kernel="gemm_fp8_tc_64x128",
             args=(Arg("params", "ptr", 0),)),
     "arguments [('params', 'ptr')], the entry takes [('params', 'params')]"),
])
def test_reference_device_refuses_launches_unlike_their_entry(launch, message):
    with pytest.raises(ContractError, match=re.escape(message)):
        ReferenceDevice(_schedule(launch), memoryview(b""), b"")


def test_references_read_their_inputs_read_only():
    arena = np.zeros(ARENA, np.uint8)
    entry = registry.ENTRIES["rmsnorm_bf16"]
    call = Call(entry, (ROWS, 1, 1), {"x": X, "w": W, "y": Y, "H": H, "eps": 1e-6}, arena)
    with pytest.raises(ValueError, match="read-only"):
        call.array("x", (ROWS, H))[:] = 1
    call.array("y", (ROWS, H))[:] = 1
    with pytest.raises(ContractError, match="lies outside the arena"):
        call.array("y", (ROWS + 1, H))
