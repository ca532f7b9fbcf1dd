"""The kernel library's interface in ctypes, read from the C header that declares it
(csrc/interface.h): the structures, every function's signature and the named constants (status
codes, weight kinds), and the check that the compiler laid each struct out where ctypes does.

Why read the header rather than restate it: the structs were once copied by hand into three
Python files and 20-argument signatures declared as positional lists of types, with nothing to
notice a field added or retyped on one side only. Now a field, a parameter or a status is
written once, in C, and the compiler holds the kernels to it. The library carries a table of its
structs' sizes and fields' offsets as its compiler computed them (`kernel_layout`, generated
from the header at build time by `layout_source`), and `open_library` compares every entry with
ctypes' before the library is used: a disagreement is a bug of ours, raised, never run.

Types: C scalars map to their ctypes; a pointer to a struct of the header to a POINTER of its
structure (ctypes then refuses a pointer to any other struct); `char *` to c_char_p; every other
pointer to c_void_p (callers pass tensors' data_ptr() and ctypes arrays).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

from pagedllm.layers import c_header

HEADER = Path(__file__).with_name("csrc") / "interface.h"
INTERFACE = c_header.parse(HEADER.read_text(), HEADER.name)
_SCALARS = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int, "float": ctypes.c_float,
            "double": ctypes.c_double}


def structures(header: c_header.Header) -> dict[str, type[ctypes.Structure]]:
    """A ctypes structure per struct of `header`, named as in C, fields in the header's order.
    Build them with keywords (the order then lives in the header alone); no __dict__, so a
    misspelt keyword raises instead of setting a Python attribute and leaving the field zero."""
    built: dict[str, type[ctypes.Structure]] = {}
    for name, fields in header.structs.items():
        built[name] = type(name, (ctypes.Structure,), {
            "__doc__": f"The C struct {name}.",
            "__module__": __name__,
            "__slots__": (),
            "_fields_": [(f.name, ctype(f.type, built)) for f in fields],
        })
    return built


def ctype(t: c_header.CType, structs: dict[str, type[ctypes.Structure]]):
    """The ctypes type of a C type of the header (None: void)."""
    if t.pointers == 0:
        return None if t.base == "void" else structs.get(t.base) or _SCALARS[t.base]
    if t.pointers == 1 and t.base == "char":
        return ctypes.c_char_p
    if t.pointers == 1 and t.base in structs:
        return ctypes.POINTER(structs[t.base])
    return ctypes.c_void_p


STRUCTS = structures(INTERFACE)
Matrix, Layer, Model, Step = STRUCTS["Matrix"], STRUCTS["Layer"], STRUCTS["Model"], STRUCTS["Step"]
Speculation, LayoutEntry, Draws = STRUCTS["Speculation"], STRUCTS["LayoutEntry"], STRUCTS["Draws"]
STATUSES: dict[str, int] = INTERFACE.enums["KernelStatus"]
WEIGHT_KINDS: dict[str, int] = INTERFACE.enums["WeightKind"]


class KernelLibrary(ctypes.CDLL):
    """The loaded kernel library, whose functions are those of the header, each declared from
    it. Any other name is refused: ctypes would call it with its default signature (int
    arguments and result), truncating pointers and int64s without a word."""

    def __getattr__(self, name: str):
        if name not in INTERFACE.functions:
            raise AttributeError(f"{name} is not a function of the kernel library's interface ({HEADER.name})")
        return super().__getattr__(name)


class LayoutMismatch(RuntimeError):
    """The compiler and ctypes disagree on where a struct's fields lie: the header holds
    something the Python side reads differently (a bug of ours)."""


def open_library(path: Path | str) -> KernelLibrary:
    """The library at `path`, every function of the header declared, its layouts checked."""
    library = KernelLibrary(str(path))
    for function in INTERFACE.functions.values():
        declared = getattr(library, function.name)
        declared.restype = ctype(function.returns, STRUCTS)
        declared.argtypes = [ctype(p.type, STRUCTS) for p in function.params]
    mismatches = layout_mismatches(library)
    if mismatches:
        raise LayoutMismatch(f"{path}: the C and ctypes layouts of {HEADER.name} differ: " + "; ".join(mismatches))
    return library


def layout_source(header: c_header.Header = INTERFACE) -> str:
    """The C source of the library's kernel_layout(): a row for each struct of the header and
    one for each of its fields, with the sizes and offsets the compiler gives them."""
    rows = []
    for name, fields in header.structs.items():
        rows.append(f'    {{"{name}", sizeof({name}), 0}},')
        rows += [f'    {{"{name}.{f.name}", sizeof((({name} *)0)->{f.name}), offsetof({name}, {f.name})}},' for f in fields]
    return "\n".join([
        f"/* Generated from {HEADER.name} by layers/kernel_interface.py when the library is built. */",
        "#include <stddef.h>",
        "",
        f'#include "{HEADER.name}"',
        "",
        "static const LayoutEntry layout[] = {",
        *rows,
        "};",
        "",
        "const LayoutEntry *kernel_layout(int64_t *count) {",
        "    *count = (int64_t)(sizeof layout / sizeof layout[0]);",
        "    return layout;",
        "}",
        "",
    ])


def compiled_layout(library: ctypes.CDLL) -> dict[str, tuple[int, int]]:
    """(size, offset) of each struct and field, as the library's compiler laid them out."""
    count = ctypes.c_int64()
    table = library.kernel_layout(ctypes.byref(count))
    return {table[i].name.decode(): (table[i].size, table[i].offset) for i in range(count.value)}


def ctypes_layout(structs: dict[str, type[ctypes.Structure]]) -> dict[str, tuple[int, int]]:
    """The same, as ctypes lays out `structs`."""
    layout = {}
    for name, struct in structs.items():
        layout[name] = (ctypes.sizeof(struct), 0)
        for field, _ in struct._fields_:
            descriptor = getattr(struct, field)
            layout[f"{name}.{field}"] = (descriptor.size, descriptor.offset)
    return layout


def layout_mismatches(library: ctypes.CDLL, structs: dict[str, type[ctypes.Structure]] | None = None) -> list[str]:
    """Each struct or field whose (size, offset) differs between the library and `structs`
    (default: the header's), or that only one of them has."""
    compiled, ours = compiled_layout(library), ctypes_layout(STRUCTS if structs is None else structs)
    return [f"{name}: C (size, offset) {compiled.get(name)}, ctypes {ours.get(name)}"
            for name in sorted(compiled.keys() | ours.keys()) if compiled.get(name) != ours.get(name)]
