"""The kernel library's interface, declared once in csrc/interface.h: every struct's size and
every field's offset as the compiler laid them out (the table built into the library) equal
ctypes' for both instruction sets; a header the Python side read differently would be caught;
every function is declared from the header and no other can be called; every status code has
one meaning and one exception."""
from __future__ import annotations

import ctypes

import pytest

from pagedllm.layers import c_header, kernel_interface, kernels
from pagedllm.layers.kernel_interface import HEADER, INTERFACE, STATUSES, STRUCTS

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler on this machine")
def test_every_struct_and_field_lies_where_the_compiler_put_it(library):
    compiled = kernel_interface.compiled_layout(library)
    assert compiled == kernel_interface.ctypes_layout(STRUCTS)
    fields = sum(len(f) for f in INTERFACE.structs.values())
    assert len(compiled) == len(INTERFACE.structs) + fields  # every struct and every field of the header
    assert {"Matrix", "Layer", "Model", "Step", "Speculation"} <= INTERFACE.structs.keys()
    assert kernel_interface.layout_mismatches(library) == []


@pytest.mark.parametrize("edit, wrong", [
    (("int64_t window;", "int32_t window;"), ["Layer.window"]),  # a narrower field (the struct's padding hides it)
    (("float eps, attn_scale;", "double eps, attn_scale;"), ["Model", "Model.attn_scale", "Model.embed_rows"]),
    (("    int32_t reserved;\n", ""), ["Matrix.reserved"]),  # a field one side lacks (alignment keeps the rest)
])
def test_a_layout_read_differently_from_the_compilers_is_caught(edit, wrong):
    library = kernels.load()
    text = HEADER.read_text()
    assert edit[0] in text
    misread = kernel_interface.structures(c_header.parse(text.replace(edit[0], edit[1])))
    mismatches = kernel_interface.layout_mismatches(library, misread)
    named = {m.split(":")[0] for m in mismatches}
    assert set(wrong) <= named


def test_every_function_is_declared_from_the_header_and_no_other_is_callable(library):
    for function in INTERFACE.functions.values():
        declared = getattr(library, function.name)
        assert len(declared.argtypes) == len(function.params), function.name
    assert library.decode_step.argtypes == [ctypes.POINTER(kernel_interface.Model), ctypes.POINTER(kernel_interface.Step),
                                            ctypes.c_int]
    assert library.paged_decode_f32.argtypes[-2:] == [ctypes.c_float, ctypes.c_int] and library.panel_width.restype is ctypes.c_int64
    with pytest.raises(AttributeError, match="not a function of the kernel library's interface"):
        library.attend_rows  # exported by the C code for its own use, not declared for Python
    step = kernel_interface.Step()
    with pytest.raises(ctypes.ArgumentError, match="expected LP_Model instance instead of pointer to Step"):
        library.decode_step(ctypes.byref(step), ctypes.byref(step), 1)  # a pointer to another struct than the header's


def test_every_status_has_one_value_and_its_own_exception():
    library = kernels.load()
    assert len(set(STATUSES.values())) == len(STATUSES) and STATUSES["KERNEL_OK"] == 0
    assert (kernels.KERNEL_OK, kernels.KERNEL_NO_MEMORY, kernels.KERNEL_BAD_SHAPE, kernels.KERNEL_REFUSED) == tuple(
        STATUSES[n] for n in ("KERNEL_OK", "KERNEL_NO_MEMORY", "KERNEL_BAD_SHAPE", "KERNEL_REFUSED"))
    raised = set()
    for name, status in STATUSES.items():
        if name == "KERNEL_OK":
            kernels.check_status(status, library, "test")
            continue
        with pytest.raises(Exception) as exc:
            kernels.check_status(status, library, "test")
        assert "not one of interface.h's" not in str(exc.value), name
        raised.add(type(exc.value))
    assert len(raised) == len(STATUSES) - 1  # each failure its own exception
    with pytest.raises(RuntimeError, match="status 99, not one of interface.h's"):
        kernels.check_status(99, library, "test")


def test_the_python_constants_are_the_headers():
    from pagedllm.layers import small_matmul

    kinds = INTERFACE.enums["WeightKind"]
    assert (small_matmul.WEIGHT_F32, small_matmul.WEIGHT_I8, small_matmul.WEIGHT_Q8_0, small_matmul.WEIGHT_Q4) == (
        kinds["WEIGHT_F32"], kinds["WEIGHT_I8"], kinds["WEIGHT_Q8_0"], kinds["WEIGHT_Q4"])
    assert small_matmul.MatrixStruct is STRUCTS["Matrix"]


def test_a_struct_built_with_a_misspelt_field_is_refused():
    assert kernel_interface.Step(rows=2, max_blocks=3).max_blocks == 3
    with pytest.raises(AttributeError):
        kernel_interface.Step(rows=2, max_block=3)  # would otherwise leave max_blocks 0 without a word
