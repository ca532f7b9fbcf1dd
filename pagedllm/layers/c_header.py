"""A reader for the small subset of C that the kernel library's interface (csrc/interface.h) is
written in: its enums, structs and function prototypes as data.

Why a parser of our own rather than pycparser: the header is a few structs and prototypes, read
at import time on every machine the engine runs on, and pycparser would need a preprocessor run
(or fake system headers) and a new dependency for that. Why refuse rather than skip what it does
not know: a construct read wrongly (an array field, a macro-sized member, a field under #ifdef)
would give Python a struct of another layout than the compiler's, so anything outside the subset
is an error naming its line. The subset:

  - comments; `#include <...>`, and the include guard's `#ifndef NAME` / `#define NAME` / `#endif`
    (any other preprocessor line is refused);
  - `enum Name { A = 0, B = 1 };`: every member with an explicit integer value;
  - `typedef struct { fields } Name;`: each field line `[const] type [*]name[, [*]name ...];` where
    type is a scalar of SCALARS, a struct declared above, or `void` / `char` behind a pointer;
  - prototypes `[const] type [*]name(params);`, params as fields are (one per comma) or `void`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

SCALARS = ("int64_t", "int32_t", "int", "float", "double")
_POINTEE_ONLY = ("void", "char")  # types that appear only behind a pointer (or void as a return type)
_TOKEN = re.compile(r"(?P<name>[A-Za-z_]\w*)|(?P<number>-?\d+)|(?P<punct>[{}();,*=])|(?P<space>\s+)")
_DIRECTIVE = re.compile(r"#\s*(include\s*<[\w./]+>|ifndef\s+\w+|define\s+\w+|endif)\s*$")


class HeaderError(ValueError):
    """The header uses C outside the subset this module reads (the message names the line)."""


@dataclass(frozen=True)
class CType:
    """A field's, parameter's or return value's type: `base` behind `pointers` stars."""

    base: str  # a scalar of SCALARS, void, char, or a struct's name
    pointers: int = 0
    const: bool = False


@dataclass(frozen=True)
class Declaration:
    """A struct's field or a function's parameter."""

    name: str
    type: CType


@dataclass(frozen=True)
class Function:
    name: str
    returns: CType
    params: tuple[Declaration, ...]


@dataclass
class Header:
    """What the header declares, each kind in the order it was declared."""

    enums: dict[str, dict[str, int]] = field(default_factory=dict)
    structs: dict[str, tuple[Declaration, ...]] = field(default_factory=dict)
    functions: dict[str, Function] = field(default_factory=dict)

    def constants(self) -> dict[str, int]:
        """Every enum member, by name."""
        return {name: value for members in self.enums.values() for name, value in members.items()}


def parse(text: str, source: str = "header") -> Header:
    """The declarations of `text`; HeaderError (with `source` and the line) for anything outside
    the subset."""
    return _Parser(_tokens(text, source), source).header()


def _strip_comments(text: str) -> str:
    """Comments blanked out, their newlines kept (for line numbers)."""
    return re.sub(r"/\*.*?\*/|//[^\n]*", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)


def _tokens(text: str, source: str) -> list[tuple[str, int]]:
    """(token, line) pairs of the code outside comments and the allowed preprocessor lines."""
    tokens = []
    for number, line in enumerate(_strip_comments(text).splitlines(), start=1):
        if line.lstrip().startswith("#"):
            if not _DIRECTIVE.match(line.strip()):
                raise HeaderError(f"{source}:{number}: a preprocessor line outside the subset: {line.strip()!r}")
            continue
        at = 0
        while at < len(line):
            match = _TOKEN.match(line, at)
            if match is None:
                raise HeaderError(f"{source}:{number}: unexpected {line[at:].strip()[:20]!r}")
            if match.lastgroup != "space":
                tokens.append((match.group(), number))
            at = match.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[tuple[str, int]], source: str):
        self.tokens, self.source, self.at = tokens, source, 0
        self.result = Header()

    def header(self) -> Header:
        while self.at < len(self.tokens):
            if self.peek() == "enum":
                self.enum()
            elif self.peek() == "typedef":
                self.struct()
            else:
                self.function()
        return self.result

    def enum(self) -> None:
        self.expect("enum")
        name = self.name()
        self.expect("{")
        members: dict[str, int] = {}
        while self.peek() != "}":
            member = self.name()
            value = self.next() if self.next() == "=" else None
            if value is None or not re.fullmatch(r"-?\d+", value):
                self.fail(f"enum {name}: {member} needs an explicit integer value")
            members[member] = int(value)
            if self.peek() != "}":
                self.expect(",")
        self.expect("}")
        self.expect(";")
        self.declare(self.result.enums, name, members)

    def struct(self) -> None:
        self.expect("typedef")
        self.expect("struct")
        self.expect("{")
        fields: list[Declaration] = []
        while self.peek() != "}":
            const, base = self.base_type()
            while True:
                fields.append(self.declarator(const, base))
                if fields[-1].name in [f.name for f in fields[:-1]]:
                    self.fail(f"the field {fields[-1].name} is named twice")
                if self.peek() != ",":
                    break
                self.next()
            self.expect(";")
        self.expect("}")
        name = self.name()
        self.expect(";")
        if not fields:
            self.fail(f"struct {name} has no fields")
        self.declare(self.result.structs, name, tuple(fields))

    def function(self) -> None:
        const, base = self.base_type()
        returns = self.declarator(const, base, returning=True)
        self.expect("(")
        params: list[Declaration] = []
        if self.peek() == "void" and self.peek(1) == ")":
            self.next()
        else:
            while True:
                params.append(self.declarator(*self.base_type()))
                if self.peek() != ",":
                    break
                self.next()
        self.expect(")")
        self.expect(";")
        self.declare(self.result.functions, returns.name, Function(returns.name, returns.type, tuple(params)))

    def base_type(self) -> tuple[bool, str]:
        const = self.peek() == "const"
        if const:
            self.next()
        base = self.name()
        if base not in SCALARS and base not in _POINTEE_ONLY and base not in self.result.structs:
            self.fail(f"unknown type {base!r} (the subset knows {', '.join(SCALARS)}, void/char pointers and the "
                      "structs declared above)")
        return const, base

    def declarator(self, const: bool, base: str, returning: bool = False) -> Declaration:
        pointers = 0
        while self.peek() == "*":
            self.next()
            pointers += 1
        name = self.name()
        if base in _POINTEE_ONLY and pointers == 0 and not (base == "void" and returning):
            self.fail(f"{name}: {base} only behind a pointer")
        return Declaration(name, CType(base, pointers, const))

    def declare(self, table: dict, name: str, value) -> None:
        if name in self.result.enums or name in self.result.structs or name in self.result.functions:
            self.fail(f"{name} is declared twice")
        table[name] = value

    def name(self) -> str:
        token = self.next()
        if not re.fullmatch(r"[A-Za-z_]\w*", token) or token in ("const", "struct", "enum", "typedef"):
            self.fail(f"expected a name, got {token!r}")
        return token

    def expect(self, token: str) -> None:
        got = self.next()
        if got != token:
            self.fail(f"expected {token!r}, got {got!r}")

    def peek(self, ahead: int = 0) -> str | None:
        at = self.at + ahead
        return self.tokens[at][0] if at < len(self.tokens) else None

    def next(self) -> str:
        if self.at >= len(self.tokens):
            self.fail("unexpected end of the header")
        self.at += 1
        return self.tokens[self.at - 1][0]

    def fail(self, message: str):
        line = self.tokens[max(self.at - 1, 0)][1] if self.tokens else 1  # the token read last
        raise HeaderError(f"{self.source}:{line}: {message}")
