"""The reader of the kernel interface's C subset: every construct interface.h uses read as the
compiler reads it, and anything outside the subset refused with its line rather than skipped."""
from __future__ import annotations

import pytest

from pagedllm.layers.c_header import CType, Declaration, HeaderError, parse

SAMPLE = """/* a header; comments may hold ; { } and * */
#ifndef SAMPLE_H
#define SAMPLE_H
#include <stdint.h>

enum Status { OK = 0, FAILED = 1, NEGATIVE = -2, };  // a trailing comma

typedef struct {
    const void *data;
    int64_t n, *lens, **rows; /* one base type, several declarators */
    float scale;
} Inner;

typedef struct {
    Inner first, second;
    const Inner *more;
    int32_t kind;
} Outer;

int run(const Outer *outer, Inner *inner, int64_t count, double *seconds);
const char *name(void);
void reset(void);
#endif
"""


def test_a_header_in_the_subset_is_read_as_declared():
    header = parse(SAMPLE)
    assert header.enums == {"Status": {"OK": 0, "FAILED": 1, "NEGATIVE": -2}}
    assert header.constants() == {"OK": 0, "FAILED": 1, "NEGATIVE": -2}
    assert header.structs["Inner"] == (
        Declaration("data", CType("void", 1, const=True)),
        Declaration("n", CType("int64_t")),
        Declaration("lens", CType("int64_t", 1)),
        Declaration("rows", CType("int64_t", 2)),
        Declaration("scale", CType("float")),
    )
    assert [f.name for f in header.structs["Outer"]] == ["first", "second", "more", "kind"]
    assert header.structs["Outer"][2].type == CType("Inner", 1, const=True)
    run = header.functions["run"]
    assert run.returns == CType("int") and [p.name for p in run.params] == ["outer", "inner", "count", "seconds"]
    assert run.params[0].type == CType("Outer", 1, const=True) and run.params[3].type == CType("double", 1)
    assert header.functions["name"].returns == CType("char", 1, const=True) and header.functions["name"].params == ()
    assert header.functions["reset"].returns == CType("void")
    assert list(header.functions) == ["run", "name", "reset"]  # declaration order


@pytest.mark.parametrize("body, line, reason", [
    ("typedef struct {\n  int64_t rows[4];\n} S;", 3, "unexpected '\\[4\\]"),  # an array field
    ("#define N 4", 2, "preprocessor line outside the subset"),  # a macro with a value
    ("#ifdef WIDE\n#endif", 2, "preprocessor line outside the subset"),  # conditional fields
    ("typedef struct {\n  size_t n;\n} S;", 3, "unknown type 'size_t'"),
    ("typedef struct {\n  unsigned int n;\n} S;", 3, "unknown type 'unsigned'"),
    ("typedef struct {\n  Later *p;\n} S;", 3, "unknown type 'Later'"),  # a struct used before it is declared
    ("typedef union {\n  int a;\n} U;", 2, "expected 'struct', got 'union'"),
    ("typedef struct {\n  int a : 3;\n} S;", 3, "unexpected ':"),  # a bit-field
    ("typedef struct {\n  void nothing;\n} S;", 3, "void only behind a pointer"),
    ("typedef struct {\n  int a,\n      a;\n} S;", 4, "the field a is named twice"),
    ("enum E {\n  A = 0,\n  B\n};", 5, "B needs an explicit integer value"),
    ("enum E { A = 1 << 2 };", 2, "unexpected '<<"),
    ("int call(int (*callback)(int));", 2, "expected a name, got '\\('"),  # a function pointer
    ("int f(void);\nint f(void);", 3, "f is declared twice"),
    ("int f(int x)", 2, "unexpected end of the header"),
])
def test_what_lies_outside_the_subset_is_refused_with_its_line(body, line, reason):
    with pytest.raises(HeaderError, match=f"^sample.h:{line}: .*{reason}"):
        parse("/* line 1 */\n" + body, "sample.h")
