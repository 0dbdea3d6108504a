#!/usr/bin/env python3
"""Writes sim/cuda_api.gen.h, the driver ABI table of the simulated driver, from CUDA's own
cuda.h and cudaTypedefs.h.

The table has two X-macro sections, each compiled only where its macro is defined:

- ``SIM_ENTRY(abi_name, nargs, "kinds")``: every function name the real libcuda.so.1
  exports as cuda.h declares it (the current names, the older ABI variants cuda.h declares
  under ``__CUDA_API_VERSION_INTERNAL`` and the per-thread-stream ``_ptds``/``_ptsz``
  variants), in strcmp order; ``kinds`` has one letter per parameter (see ``classify``).
- ``SIM_PROC(base, abi, first_version, per_thread)``: one row per ``PFN_<base>_v<version>``
  typedef of cudaTypedefs.h: which exported name cuGetProcAddress answers for ``base``
  from that CUDA version on.

The names come from running the C preprocessor over cuda.h in each of its modes and
reading the ``CUresult name(...)`` declarations out of the result, their parameter types
through the header's own typedefs. Each proc row is checked three ways: the function it
names is declared, with the very parameter types of the PFN typedef, and cuda.h's own
``#define name name_vN`` renames agree with it. Anything this script cannot read or that
does not add up makes it stop with an error (exit status 2) rather than guess.

    python sim/gen_api.py             # rewrite sim/cuda_api.gen.h
    python sim/gen_api.py --check     # exit 1 if the committed file is not what it would write
    python sim/gen_api.py --include DIR   # read DIR/cuda.h instead of the installed headers
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "cuda_api.gen.h"
REGENERATE = "python sim/gen_api.py"

# The preprocessor runs over cuda.h: plain, as a program built with per-thread default
# streams sees it, and as the driver's own build sees it (which also declares the older
# ABI variants and, implying per-thread streams, the _ptds/_ptsz names).
MODES: dict[str, list[str]] = {
    "plain": [],
    "per-thread": ["-DCUDA_API_PER_THREAD_DEFAULT_STREAM"],
    "internal": ["-D__CUDA_API_VERSION_INTERNAL"],
    "internal+per-thread": [
        "-D__CUDA_API_VERSION_INTERNAL",
        "-DCUDA_API_PER_THREAD_DEFAULT_STREAM",
    ],
}

# Exceptions to the pairing rule of proc_rows(): (base, version, per_thread) to the exported
# name that typedef stands for, each with a comment saying where cuda.h settles it. CUDA
# 13.0 needs none: every base's typedefs pair in order with its exported names, each pair
# with the same parameter types, in agreement with cuda.h's #define renames. The closest
# calls are cuCtxSynchronize, cuCtxGetDevice (v13000) and cuStreamGetCtx (v12050), whose
# _v2 are functions of their own in cuda.h rather than targets of a #define; the typedefs'
# parameter lists, (CUcontext) for PFN_cuCtxSynchronize_v13000 say, match the _v2 ones.
PROC_EXCEPTIONS: dict[tuple[str, int, bool], str] = {}


class GenError(Exception):
    """Something in the headers this script cannot read, or that does not add up."""


# --- C types ----------------------------------------------------------------------------

Kind = Literal["int", "float", "void", "struct", "union", "enum", "ptr", "array", "func"]


@dataclass(frozen=True)
class CType:
    """A C type, as much of one as classifying a parameter needs."""

    kind: Kind
    size: int = 0  # int and float: the width in bytes (LP64)
    spelled: str = ""  # int, float and void: the base type's words; tagged: "struct X"
    const: bool = False  # this level is const-qualified
    target: CType | None = None  # ptr, array: what is pointed at; func: the return type
    params: tuple[CType, ...] = ()  # func: the parameters' types
    typedef: str = ""  # the typedef name this level was spelled as, if any

    def show(self) -> str:
        """A readable spelling, for error messages."""
        const = "const " if self.const else ""
        if self.typedef:
            return f"{const}{self.typedef}"
        if self.kind in ("ptr", "array") and self.target is not None:
            return f"{self.target.show()} *{' const' if self.const else ''}"
        if self.kind == "func":
            return "function"
        return f"{const}{self.spelled}"


def spell(t: CType) -> str:
    """t with every typedef resolved, spelled C-like: two parameter types are the same
    type exactly when their spellings are equal."""
    const = "const " if t.const else ""
    if t.kind in ("ptr", "array"):
        return f"{spell(pointee(t))} *{' const' if t.const else ''}"
    if t.kind == "func":
        return f"{spell(pointee(t))} (*)({', '.join(spell(p) for p in t.params)})"
    return f"{const}{t.spelled}"


def pointee(t: CType) -> CType:
    if t.target is None:
        raise GenError(f"pointer type without a target: {t}")
    return t.target


# The base types of the LP64 ABI: each spelling (by its sorted words) gives a canonical
# name and a width in bytes.
_BASE_TYPES: dict[tuple[str, ...], tuple[Kind, str, int]] = {}
for _kind, _name, _size, _spellings in (
    ("int", "char", 1, ["char"]),
    ("int", "signed char", 1, ["signed char"]),
    ("int", "unsigned char", 1, ["unsigned char"]),
    ("int", "_Bool", 1, ["_Bool"]),
    ("int", "short", 2, ["short", "short int", "signed short", "signed short int"]),
    ("int", "unsigned short", 2, ["unsigned short", "unsigned short int"]),
    ("int", "int", 4, ["int", "signed", "signed int"]),
    ("int", "unsigned int", 4, ["unsigned", "unsigned int"]),
    ("int", "long", 8, ["long", "long int", "signed long", "signed long int"]),
    ("int", "unsigned long", 8, ["unsigned long", "unsigned long int"]),
    ("int", "long long", 8, ["long long", "long long int", "signed long long"]),
    ("int", "long long", 8, ["signed long long int"]),
    ("int", "unsigned long long", 8, ["unsigned long long", "unsigned long long int"]),
    ("float", "float", 4, ["float"]),
    ("float", "double", 8, ["double"]),
    ("void", "void", 0, ["void"]),
):
    for _s in _spellings:
        _BASE_TYPES[tuple(sorted(_s.split()))] = (_kind, _name, _size)  # type: ignore[assignment]
_BASE_WORDS = {w for key in _BASE_TYPES for w in key}


def base_type(words: list[str]) -> CType:
    key = tuple(sorted(words))
    if key not in _BASE_TYPES:
        raise GenError(f"unknown base type {' '.join(words)!r}")
    kind, name, size = _BASE_TYPES[key]
    return CType(kind, size=size, spelled=name)


def is_char(t: CType) -> bool:
    return t.kind == "int" and t.spelled in ("char", "signed char", "unsigned char")


def classify(t: CType, where: str) -> str:
    """The kind letter of a parameter of type t:

    i: integer or enum of 32 bits or less, by value      q: 64-bit integer by value
    p: a pointer the callee reads (const pointee, struct/union/void/char buffer, function,
       or a typedef'd pointer such as a handle)            s: const char * (a string)
    O: non-const pointer to an 8-byte pointee             I: non-const pointer to 4 bytes
    f: float or double by value                           S: struct or union by value
    """
    if t.kind in ("array", "func"):
        raise GenError(f"{where}: parameter type {t.show()} was not adjusted to a pointer")
    if t.kind == "ptr":
        if t.typedef:  # a handle (CUcontext, CUstream, ...) or a function pointer type
            return "p"
        to = pointee(t)
        if to.const:
            return "s" if to.kind == "int" and to.spelled == "char" else "p"
        if to.kind in ("func", "struct", "union", "void"):
            return "p"
        if to.kind == "ptr":
            return "O"
        if is_char(to):
            return "p"  # a char buffer the callee fills
        if to.kind in ("int", "enum", "float"):
            size = 4 if to.kind == "enum" else to.size
            if size == 8:
                return "O"
            if size == 4:
                return "I"
        raise GenError(f"{where}: cannot classify parameter type {t.show()}")
    if t.kind == "enum":
        return "i"
    if t.kind == "int":
        if t.size <= 4:
            return "i"
        if t.size == 8:
            return "q"
    if t.kind == "float":
        return "f"
    if t.kind in ("struct", "union"):
        return "S"
    raise GenError(f"{where}: cannot classify parameter type {t.show()}")


# --- tokens and declarations ------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<id>[A-Za-z_]\w*)
      | (?P<num>\.?\d(?:[\w.]|[eEpP][+-])*)
      | (?P<str>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')
      | (?P<punct>\.\.\.|<<=|>>=|->|\+\+|--|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&|^!~<>=?:;,.(){}\[\]#])
    )""",
    re.X,
)

_IGNORED = {"__extension__", "__restrict", "__restrict__", "restrict", "volatile", "__volatile__"}
_IGNORED |= {"register", "auto", "_Noreturn", "__inline", "__inline__"}
_ATTRIBUTES = {"__attribute__", "__attribute", "__asm__", "__asm", "asm", "__declspec"}
_ATTRIBUTES |= {"_Alignas", "__alignof__"}
_STORAGE = {"typedef", "extern", "static", "inline"}


def tokenize(text: str) -> list[str]:
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    toks: list[str] = []
    pos = 0
    while True:
        m = _TOKEN.match(text, pos)
        if not m:
            if text[pos:].strip():
                raise GenError(
                    f"cannot tokenize the preprocessed header at: {text[pos : pos + 60]!r}"
                )
            return toks
        toks.append(m.group(m.lastgroup or "id"))
        pos = m.end()


def _skip_group(toks: Sequence[str], i: int) -> int:
    """toks[i] opens a bracket: the index past its matching close."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = [pairs[toks[i]]]
    i += 1
    while stack:
        if i >= len(toks):
            raise GenError("unbalanced brackets in the preprocessed header")
        if toks[i] in pairs:
            stack.append(pairs[toks[i]])
        elif toks[i] == stack[-1]:
            stack.pop()
        elif toks[i] in (")", "]", "}"):
            raise GenError(f"mismatched {toks[i]!r} in the preprocessed header")
        i += 1
    return i


def statements(toks: Sequence[str]) -> Iterable[list[str]]:
    """The top-level declarations of a translation unit, without their ';' and with
    attributes and asm labels taken out; a function definition is one statement."""
    cur: list[str] = []
    i = 0
    while i < len(toks):
        t = toks[i]
        if t in _ATTRIBUTES and i + 1 < len(toks) and toks[i + 1] == "(":
            i = _skip_group(toks, i + 1)
            continue
        if t in _IGNORED:
            i += 1
            continue
        if t == ";":
            if cur:
                yield cur
            cur = []
            i += 1
            continue
        if t in ("(", "[", "{"):
            end = _skip_group(toks, i)
            body_of_function = t == "{" and cur and cur[-1] == ")"
            # Attributes nested inside a group are stripped by the parser's own pass.
            cur.extend(toks[i:end])
            i = end
            if body_of_function:
                yield cur
                cur = []
            continue
        cur.append(t)
        i += 1
    if cur:
        raise GenError(f"the preprocessed header ends inside a declaration: {' '.join(cur[:20])}")


def strip_attributes(toks: Sequence[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(toks):
        if toks[i] in _ATTRIBUTES and i + 1 < len(toks) and toks[i + 1] == "(":
            i = _skip_group(toks, i + 1)
        elif toks[i] in _IGNORED:
            i += 1
        else:
            out.append(toks[i])
            i += 1
    return out


@dataclass
class Specifiers:
    type: CType
    storage: set[str]


class DeclParser:
    """Reads one C declaration: specifiers, then declarators."""

    def __init__(self, toks: Sequence[str], typedefs: dict[str, CType]) -> None:
        self.toks = list(toks)
        self.pos = 0
        self.typedefs = typedefs

    def peek(self, k: int = 0) -> str:
        i = self.pos + k
        return self.toks[i] if i < len(self.toks) else ""

    def take(self, expected: str | None = None) -> str:
        t = self.peek()
        if expected is not None and t != expected:
            raise GenError(f"expected {expected!r}, found {t!r} in: {' '.join(self.toks)}")
        if not t:
            raise GenError(f"unexpected end of declaration: {' '.join(self.toks)}")
        self.pos += 1
        return t

    def at_end(self) -> bool:
        return self.pos >= len(self.toks)

    def specifiers(self) -> Specifiers:
        storage: set[str] = set()
        const = False
        words: list[str] = []
        found: CType | None = None
        while not self.at_end():
            t = self.peek()
            if t in _STORAGE:
                storage.add(t)
            elif t == "const":
                const = True
            elif t in _BASE_WORDS:
                words.append(t)
            elif t in ("struct", "union", "enum") and found is None and not words:
                self.take()
                tag = ""
                if re.fullmatch(r"[A-Za-z_]\w*", self.peek()):
                    tag = self.take()
                if self.peek() == "{":
                    self.pos = _skip_group(self.toks, self.pos)
                elif not tag:
                    raise GenError(f"anonymous {t} without a body: {' '.join(self.toks)}")
                found = CType(t, spelled=f"{t} {tag}".strip())  # type: ignore[arg-type]
                continue
            elif re.fullmatch(r"[A-Za-z_]\w*", t) and found is None and not words:
                if t not in self.typedefs:
                    raise GenError(f"unknown type name {t!r} in: {' '.join(self.toks[:40])}")
                found = replace(self.typedefs[t], typedef=t)
            else:
                break
            self.pos += 1
        if found is not None and words:
            raise GenError(f"mixed type specifiers in: {' '.join(self.toks)}")
        if found is None:
            if not words:
                raise GenError(f"no type in declaration: {' '.join(self.toks[:40])}")
            found = base_type(words)
        if const:
            found = replace(found, const=True)
        return Specifiers(found, storage)

    def declarator(self, base: CType) -> tuple[str, CType]:
        """A (possibly abstract) declarator over base: its name ("" if none) and type."""
        while self.peek() == "*":
            self.take()
            const = False
            while self.peek() == "const":
                self.take()
                const = True
            base = CType("ptr", target=base, const=const)
        if self.peek() == "(" and self.peek(1) in ("*", "("):
            # A nested declarator, "(*name)(params)": the suffixes after it apply first.
            start = self.pos
            self.pos = _skip_group(self.toks, self.pos)
            outer = self.suffixes(base)
            end = self.pos
            self.pos = start + 1
            name, t = self.declarator(outer)
            self.take(")")
            self.pos = end
            return name, t
        name = ""
        if re.fullmatch(r"[A-Za-z_]\w*", self.peek()):
            name = self.take()
        return name, self.suffixes(base)

    def suffixes(self, base: CType) -> CType:
        found: list[tuple[str, tuple[CType, ...]]] = []
        while self.peek() in ("(", "["):
            if self.take() == "[":
                self.pos = _skip_group(self.toks, self.pos - 1)
                found.append(("array", ()))
            else:
                found.append(("func", self.parameters()))
        for kind, params in reversed(found):
            if kind == "array":
                base = CType("array", target=base)
            else:
                base = CType("func", target=base, params=params)
        return base

    def parameters(self) -> tuple[CType, ...]:
        """A parameter list, its '(' already taken; arrays and functions adjusted to
        pointers as C does."""
        if self.peek() == "void" and self.peek(1) == ")":
            self.pos += 2
            return ()
        params: list[CType] = []
        while True:
            if self.peek() == "...":
                raise GenError(f"variadic function in: {' '.join(self.toks)}")
            spec = self.specifiers()
            _, t = self.declarator(spec.type)
            if t.kind == "array":
                t = CType("ptr", target=pointee(t))
            elif t.kind == "func":
                t = CType("ptr", target=t)
            params.append(t)
            if self.take() == ")":
                return tuple(params)
            if self.toks[self.pos - 1] != ",":
                raise GenError(f"bad parameter list in: {' '.join(self.toks)}")


# Structs passed by value that x86-64 puts on the stack (more than 16 bytes), by their
# resolved spelling, with their size in words: the 64-byte IPC handles. Every other
# struct parameter of cuda.h is 8 bytes (CUmemLocation) and travels in one register.
STACK_STRUCTS = {"struct CUipcMemHandle_st": 8, "struct CUipcEventHandle_st": 8}
REGISTER_STRUCTS = {"struct CUmemLocation_st"}


@dataclass(frozen=True)
class Function:
    """A function's name, the kind letters of its parameters and their resolved types."""

    name: str
    kinds: str
    signature: tuple[str, ...]

    @property
    def words(self) -> str:
        """The kinds as the machine words the call passes (x86-64 SysV), which is what
        SIM_ENTRY forwards. They are the kinds themselves unless a parameter is a struct
        the ABI puts on the stack: then the integer registers come first (x: one not
        used), and the stack words after them (h: one word of such a struct)."""
        if not any(
            k == "S" and sig in STACK_STRUCTS
            for k, sig in zip(self.kinds, self.signature, strict=True)
        ):
            return self.kinds
        regs: list[str] = []
        stack: list[str] = []
        for k, sig in zip(self.kinds, self.signature, strict=True):
            if k == "S" and sig in STACK_STRUCTS:
                stack += ["h"] * STACK_STRUCTS[sig]
            elif len(regs) < 6:
                regs.append(k)
            else:
                stack.append(k)
        return "".join(regs) + "x" * (6 - len(regs)) + "".join(stack)

    @property
    def nargs(self) -> int:
        return len(self.words)


def function(name: str, t: CType) -> Function:
    kinds = "".join(classify(p, f"{name} parameter {i + 1}") for i, p in enumerate(t.params))
    signature = tuple(spell(p) for p in t.params)
    for k, sig in zip(kinds, signature, strict=True):
        if k == "S" and sig not in STACK_STRUCTS and sig not in REGISTER_STRUCTS:
            raise GenError(f"{name}: how x86-64 passes a {sig} by value is not known here")
    return Function(name, kinds, signature)


def read_unit(text: str) -> tuple[dict[str, CType], list[Function]]:
    """The typedefs and the CUresult function declarations of a preprocessed header."""
    typedefs: dict[str, CType] = {}
    functions: list[Function] = []
    for raw in statements(tokenize(text)):
        toks = strip_attributes(raw)
        if "typedef" in toks[:3]:
            parser = DeclParser(toks, typedefs)
            try:
                spec = parser.specifiers()
                if spec.type.spelled in ("struct", "union", "enum"):
                    # An anonymous struct, union or enum is known by its first typedef name.
                    first = DeclParser(toks[parser.pos :], typedefs).declarator(spec.type)[0]
                    spec.type = replace(spec.type, spelled=f"{spec.type.spelled} {first}")
                while not parser.at_end():
                    name, t = parser.declarator(spec.type)
                    if not name:
                        raise GenError(f"typedef without a name: {' '.join(toks)}")
                    typedefs[name] = t
                    if not parser.at_end():
                        parser.take(",")
            except GenError:
                # A typedef of CUDA's own must be read. One from a system header may be
                # beyond this reader; a declaration that uses it fails as an unknown type.
                if any(re.match(r"CU|cu|PFN_", t) for t in toks):
                    raise
            continue
        names = [t for t in toks if re.fullmatch(r"cu[A-Z]\w*", t)]
        if not names or toks[0] in ("static", "inline") or "{" in toks:
            continue  # not a driver entry point (inline helpers are not exported)
        parser = DeclParser(toks, typedefs)
        spec = parser.specifiers()
        if spec.storage - {"extern"}:
            continue
        name, t = parser.declarator(spec.type)
        if not parser.at_end() or t.kind != "func" or not name.startswith("cu"):
            raise GenError(f"cannot read the declaration: {' '.join(toks)}")
        if spec.type.typedef != "CUresult" or pointee(t) != spec.type:
            raise GenError(f"{name} does not return CUresult: {' '.join(toks)}")
        functions.append(function(name, t))
    return typedefs, functions


# --- reading the headers ----------------------------------------------------------------


def default_include() -> Path:
    """The include directory of the nvidia-cuda-runtime package installed in this Python."""
    spec = importlib.util.find_spec("nvidia.cu13")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        include = Path(location) / "include"
        if (include / "cuda.h").is_file():
            return include
    raise GenError(
        "no nvidia/cu13/include/cuda.h in this Python: install nvidia-cuda-runtime==13.0.96 "
        "(the project's test extra) or name a directory with --include"
    )


def preprocess(include: Path, header: str, defines: list[str]) -> str:
    cc = os.environ.get("CC", "cc")
    cmd = [cc, "-E", "-P", "-x", "c", *defines, f"-I{include}", "-"]
    try:
        done = subprocess.run(
            cmd, input=f"#include <{header}>\n", capture_output=True, text=True, check=False
        )
    except OSError as e:
        raise GenError(f"cannot run the C preprocessor {cc!r}: {e}") from e
    if done.returncode != 0:
        raise GenError(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return done.stdout


def exported_entries(include: Path) -> dict[str, Function]:
    """Every CUresult function cuda.h declares in any of its modes, by name. Two
    declarations of one name must agree on its parameters."""
    entries: dict[str, Function] = {}
    seen_in: dict[str, str] = {}
    for mode, defines in MODES.items():
        _, functions = read_unit(preprocess(include, "cuda.h", defines))
        for f in functions:
            old = entries.setdefault(f.name, f)
            seen_in.setdefault(f.name, mode)
            if old.nargs != f.nargs:
                raise GenError(
                    f"{f.name} is declared with {old.nargs} parameters ({seen_in[f.name]}) "
                    f"and with {f.nargs} ({mode})"
                )
            if old.signature != f.signature:
                raise GenError(
                    f"{f.name} is declared as ({', '.join(old.signature)}) ({seen_in[f.name]}) "
                    f"and as ({', '.join(f.signature)}) ({mode})"
                )
    return entries


_PFN = re.compile(r"\bPFN_(\w+)_v(\d+)(_ptds|_ptsz)?\b")


@dataclass(frozen=True)
class Pfn:
    base: str
    version: int
    suffix: str  # "", "_ptds" or "_ptsz"
    prototype: Function

    @property
    def name(self) -> str:
        return f"PFN_{self.base}_v{self.version}{self.suffix}"

    @property
    def per_thread(self) -> bool:
        return bool(self.suffix)


def pfn_typedefs(include: Path) -> list[Pfn]:
    """Every PFN_<base>_v<version>[_ptds|_ptsz] typedef of cudaTypedefs.h with the kinds of
    its parameters. The raw text is scanned (all of it, conditional sections included) and
    must name the same typedefs that the preprocessed header, in the mode that declares
    every section, defines."""
    raw = (include / "cudaTypedefs.h").read_text()
    raw = re.sub(r"/\*.*?\*/|//[^\n]*", " ", raw, flags=re.S)
    in_text: set[tuple[str, int, str]] = set()
    for statement in re.finditer(r"\btypedef\b[^;]*", raw):
        if m := _PFN.search(statement.group()):
            in_text.add((m.group(1), int(m.group(2)), m.group(3) or ""))
    typedefs, _ = read_unit(preprocess(include, "cudaTypedefs.h", MODES["internal"]))
    found: list[Pfn] = []
    for name, t in typedefs.items():
        m = _PFN.fullmatch(name)
        if not m:
            continue
        if t.kind != "ptr" or pointee(t).kind != "func":
            raise GenError(f"{name} is not a function pointer type")
        prototype = function(name, pointee(t))
        found.append(Pfn(m.group(1), int(m.group(2)), m.group(3) or "", prototype))
    parsed = {(p.base, p.version, p.suffix) for p in found}
    if parsed != in_text:
        raise GenError(
            "cudaTypedefs.h's text and its preprocessed form name different PFN typedefs: "
            f"only in the text {sorted(in_text - parsed)}, only preprocessed "
            f"{sorted(parsed - in_text)}"
        )
    if not found:
        raise GenError("no PFN_<name>_v<version> typedefs found in cudaTypedefs.h")
    return sorted(found, key=lambda p: (p.base, p.version, p.suffix))


def header_version(include: Path) -> int:
    m = re.search(r"^#define\s+CUDA_VERSION\s+(\d+)\s*$", (include / "cuda.h").read_text(), re.M)
    if not m:
        raise GenError("cuda.h does not #define CUDA_VERSION")
    return int(m.group(1))


# --- the proc table ---------------------------------------------------------------------


@dataclass(frozen=True)
class ProcRow:
    base: str
    abi: str
    version: int
    per_thread: bool


def abi_names(base: str, entries: dict[str, Function]) -> list[str]:
    """The exported ABI names of base, oldest first: base, base_v2, base_v3, ..."""
    names = [base] if base in entries else []
    return names + [f"{base}_v{n}" for n in range(2, 100) if f"{base}_v{n}" in entries]


def header_mappings(include: Path) -> dict[str, tuple[str, str]]:
    """cuda.h's own renames of a name to its current ABI variant, "#define cuMemAlloc
    cuMemAlloc_v2" or "#define cuLaunchKernel __CUDA_API_PTSZ(cuLaunchKernel)": name to
    (target, per-thread suffix or ""), for targets of the name's own family only
    (cuGraphInstantiate to cuGraphInstantiateWithFlags, say, is another function)."""
    raw = (include / "cuda.h").read_text()
    found: dict[str, tuple[str, str]] = {}
    define = r"^\s*#\s*define\s+(cu\w+)\s+(?:__CUDA_API_PT(DS|SZ)\(\s*(cu\w+)\s*\)|(cu\w+))\s*$"
    for m in re.finditer(define, raw, re.M):
        name, pt, target = m.group(1), m.group(2), m.group(3) or m.group(4)
        if target == name or target.startswith(f"{name}_v"):
            found[name] = (target, f"_pt{pt.lower()}" if pt else "")
    return found


def check_mapping(base: str, rows: list[ProcRow], mapping: tuple[str, str] | None) -> list[str]:
    """What is wrong with base's rows (oldest first) given cuda.h's mapping of the name: a
    rename to a newer variant must be the newest row, and its per-thread flavour the newest
    per-thread row; a name kept as it is (cuStreamGetCtx, whose cuStreamGetCtx_v2 is a
    name of its own in cuda.h) must have the per-thread flavour the mapping names."""
    if mapping is None:
        return []
    target, suffix = mapping
    legacy = [r.abi for r in rows if not r.per_thread]
    per_thread = [r.abi for r in rows if r.per_thread]
    if target != base:
        wanted = [(legacy, target)] + ([(per_thread, target + suffix)] if suffix else [])
        return [
            f"cuda.h maps {base} to {want}, but its newest typedef stands for {have[-1]}"
            for have, want in wanted
            if have and have[-1] != want
        ]
    if suffix and base + suffix not in per_thread:
        return [f"cuda.h maps {base} to {base + suffix}, which no typedef stands for"]
    return []


def proc_rows(
    pfns: list[Pfn], entries: dict[str, Function], mappings: dict[str, tuple[str, str]]
) -> list[ProcRow]:
    """The ABI name each PFN typedef stands for.

    For one base, its versions without a per-thread suffix, in ascending order, pair with
    its exported names base, base_v2, base_v3, ... in order; a per-thread typedef of version
    V stands for the non-per-thread name in force at V (the newest of version <= V) with
    its suffix. PROC_EXCEPTIONS overrides single rows (and takes their names out of the
    pairing). Every row must name an exported function whose parameters are those of the
    typedef, and agree with cuda.h's own mapping of the base name (check_mapping).
    """
    rows: list[ProcRow] = []
    problems: list[str] = []
    for base in sorted({p.base for p in pfns}):
        mine = [p for p in pfns if p.base == base]
        excepted = {k: v for k, v in PROC_EXCEPTIONS.items() if k[0] == base}
        legacy = sorted(p.version for p in mine if not p.per_thread)
        to_pair = [v for v in legacy if (base, v, False) not in excepted]
        names = [n for n in abi_names(base, entries) if n not in excepted.values()]
        if len(to_pair) != len(names):
            problems.append(
                f"{base}: {len(to_pair)} versions {to_pair} but {len(names)} exported names "
                f"{names}: add the right rows to PROC_EXCEPTIONS"
            )
            continue
        legacy_abi = dict(zip(to_pair, names, strict=True))
        legacy_abi |= {v: abi for (_, v, pt), abi in excepted.items() if not pt}
        mine_rows: list[ProcRow] = []
        for p in mine:
            abi = excepted.get((base, p.version, p.per_thread))
            if abi is None and not p.per_thread:
                abi = legacy_abi[p.version]
            elif abi is None:
                in_force = [v for v in legacy if v <= p.version]
                if not in_force:
                    problems.append(f"{p.name}: no variant without a per-thread suffix")
                    continue
                abi = legacy_abi[in_force[-1]] + p.suffix
            if abi not in entries:
                problems.append(f"{p.name} would stand for {abi}, which cuda.h does not declare")
            elif entries[abi].signature != p.prototype.signature:
                problems.append(
                    f"{p.name} takes ({', '.join(p.prototype.signature)}) but {abi} takes "
                    f"({', '.join(entries[abi].signature)})"
                )
            else:
                mine_rows.append(ProcRow(base, abi, p.version, p.per_thread))
        if len(mine_rows) == len(mine):  # each typedef stands for a function of its own
            problems += check_mapping(base, mine_rows, mappings.get(base))
        rows += mine_rows
    for base, version, per_thread in PROC_EXCEPTIONS:
        if not any(
            p.base == base and p.version == version and p.per_thread == per_thread for p in pfns
        ):
            problems.append(f"PROC_EXCEPTIONS names {base} {version}, which has no typedef")
    if problems:
        raise GenError("the PFN typedefs do not pair with cuda.h:\n  " + "\n  ".join(problems))
    return rows


# --- output -----------------------------------------------------------------------------


def render(version: int, entries: dict[str, Function], rows: list[ProcRow]) -> str:
    release = f"{version // 1000}.{version % 1000 // 10}"
    out = [
        f"/* Generated by sim/gen_api.py from CUDA {release}'s cuda.h and cudaTypedefs.h: "
        "do not edit.",
        f" * Regenerate with `{REGENERATE}` (`--check` tells whether this file is current).",
        " * kinds, one letter per parameter: i integer or enum of 32 bits or less, q 64-bit",
        " * integer, p pointer the callee reads (or a handle), s const char *, O non-const",
        " * pointer to 8 bytes, I non-const pointer to 4 bytes, f float or double, S struct or",
        " * union by value in one register. A function taking a struct the ABI puts on the",
        " * stack lists machine words instead: its register arguments, x for each register",
        " * left unused, then the stack words (h: one word of such a struct). */",
        f"#define SIM_CUDA_H_VERSION {version}            /* CUDA_VERSION of the header */",
        '/* SIM_ENTRY(abi_name, nargs, "kinds"): every exported ABI name of cuda.h, '
        "sorted by name */",
        "#ifdef SIM_ENTRY",
    ]
    out += [f'SIM_ENTRY({e.name}, {e.nargs}, "{e.words}")' for _, e in sorted(entries.items())]
    out += [
        "#endif",
        "/* SIM_PROC(base, abi, first_version, per_thread): one row per PFN typedef of "
        "cudaTypedefs.h */",
        "#ifdef SIM_PROC",
    ]
    out += [f"SIM_PROC({r.base}, {r.abi}, {r.version}, {int(r.per_thread)})" for r in rows]
    out.append("#endif")
    return "\n".join(out) + "\n"


def generate(include: Path) -> str:
    for header in ("cuda.h", "cudaTypedefs.h"):
        if not (include / header).is_file():
            raise GenError(f"no {header} in {include}")
    entries = exported_entries(include)
    rows = proc_rows(pfn_typedefs(include), entries, header_mappings(include))
    return render(header_version(include), entries, rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--include", type=Path, help="the directory of cuda.h and cudaTypedefs.h")
    ap.add_argument("--output", type=Path, default=OUTPUT, help="the file to write or check")
    ap.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    args = ap.parse_args(argv)
    try:
        text = generate(args.include or default_include())
    except GenError as e:
        print(f"gen_api: {e}", file=sys.stderr)
        return 2
    if args.check:
        current = args.output.read_text() if args.output.is_file() else None
        if current != text:
            state = "is missing" if current is None else "differs from what the headers give"
            print(
                f"gen_api: {args.output.name} {state}; regenerate it with `{REGENERATE}`",
                file=sys.stderr,
            )
            return 1
        return 0
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
