"""The engine's C kernels for CPUs (layers/csrc/*.c), built with the machine's compiler the first
time an engine needs them, cached, and loaded through ctypes.

One shared library holds them all: decode and prefill attention over the paged pool
(paged_decode.c, prefill_attention.c), small-M matmuls whose weights stream at the memory's speed (small_matmul.c) and the whole-model decode
step (decode_step.c), and greedy speculative decoding's draft-and-verify cycles built on it
(speculate.c). The instruction set is chosen at build time: `-march=native` gives
AVX-512 code on a CPU that has it and AVX2 code on one that does not (the sources switch on
`__AVX512F__`), and the library says which it got (`isa()`). Tests build the AVX2 variant on an
AVX-512 machine too (`extra_flags=("-mno-avx512f",)`), so both paths are checked wherever the
suite runs.

The build is keyed by a hash of the sources, the flags, the compiler and the CPU's feature flags
(-march=native code is only valid on CPUs with the same instruction sets) and cached under
`~/.cache/pagedllm/kernels` (`PAGEDLLM_CACHE_DIR`), or the temp dir if that is not writable;
concurrent builders race harmlessly (atomic rename). Without a compiler, or if the build fails,
`load()` returns None after one clear warning and the engine runs its PyTorch paths.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger("pagedllm.kernels")

_CSRC = Path(__file__).with_name("csrc")
SOURCES = ("paged_decode.c", "prefill_attention.c", "small_matmul.c", "decode_step.c", "greedy.c", "speculate.c")
HEADERS = ("kernels.h", "decode_step.h")
# -ffast-math (but keeping infinities) lets the reductions and exp vectorise. It is given to the
# compile step only: linked with it, gcc adds crtfastmath.o, whose constructor switches the whole
# process to flush-denormals-to-zero when the library loads.
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-fPIC", "-std=gnu11")
_LINK_FLAGS = ("-shared", "-fopenmp", "-lm")
NO_COMPILER_MESSAGE = (
    "no C compiler found (looked for gcc, cc, clang): the CPU kernels (decode attention, small-batch "
    "matmuls, the fused decode step) are disabled and the engine falls back to its PyTorch path, "
    "which is several times slower at small batches; install gcc to enable them"
)

_libraries: dict[tuple[str, ...], ctypes.CDLL | None] = {}


def compiler() -> str | None:
    return next((found for cc in ("gcc", "cc", "clang") if (found := shutil.which(cc))), None)


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedllm")
    return Path(root) / "kernels"


def _cpu_signature() -> bytes:
    try:
        flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
        return flags[0].encode() if flags else b""
    except OSError:
        return b""


def build(cc: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the sources once per (sources, flags, compiler, CPU) into the cache; the path of
    the shared library."""
    flags = (*_FLAGS, *extra_flags)
    digest = hashlib.sha256(" ".join([cc, *flags, *_LINK_FLAGS]).encode() + _cpu_signature())
    for name in (*HEADERS, *SOURCES):
        digest.update((_CSRC / name).read_bytes())
    name = f"pagedllm_kernels-{digest.hexdigest()[:16]}.so"
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / "pagedllm-kernels"):
        target = folder / name
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                objects = []
                for source in SOURCES:
                    obj = Path(tmp) / source.replace(".c", ".o")
                    subprocess.run([cc, *flags, "-c", str(_CSRC / source), "-o", str(obj)], check=True, capture_output=True, text=True)
                    objects.append(str(obj))
                built = Path(tmp) / name
                subprocess.run([cc, *objects, "-o", str(built), *_LINK_FLAGS], check=True, capture_output=True, text=True)
                os.replace(built, target)
            return target
        except PermissionError:
            continue
    raise OSError("no writable folder for the compiled CPU kernels")


def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel library built with `extra_flags`, built on first use; None (with one warning)
    if it cannot be built."""
    if extra_flags not in _libraries:
        _libraries[extra_flags] = _load(extra_flags)
    return _libraries[extra_flags]


def _load(extra_flags: tuple[str, ...]) -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        logger.warning(NO_COMPILER_MESSAGE)
        return None
    try:
        library = ctypes.CDLL(str(build(cc, extra_flags)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the CPU kernels failed (%s); the engine falls back to its PyTorch path", detail)
        return None
    _declare(library)
    return library


def _declare(library: ctypes.CDLL) -> None:
    i64, ptr, i32, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    library.paged_decode_f32.restype = i32
    library.paged_decode_f32.argtypes = [ptr, i64] + [ptr] * 5 + [i64] * 8 + [f32, i32]
    library.prefill_attention_f32.restype = i32
    library.prefill_attention_f32.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, ptr] + [i64] * 6 + [f32, i32]
    library.kernel_isa.restype = ctypes.c_char_p
    library.kernel_isa.argtypes = []
    library.panel_width.restype = i64
    library.panel_width.argtypes = []
    library.small_matmul.restype = i32
    library.small_matmul.argtypes = [ptr, ptr, i64, i64, ptr, i64, i32, i32]
    library.decode_step.restype = i32
    library.decode_step.argtypes = [ptr, ptr, i32]
    library.decode_steps.restype = i32
    library.decode_steps.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ptr]
    library.speculate_greedy.restype = i32
    library.speculate_greedy.argtypes = [ptr, ptr, ptr, i64, ptr, ptr]
    library.read_bandwidth.restype = ctypes.c_double
    library.read_bandwidth.argtypes = [ptr, i64, i32, i32]
    library.greedy_rows.restype = None
    library.greedy_rows.argtypes = [ptr, i64, i64, ptr, ptr]


def isa(library: ctypes.CDLL) -> str:
    """The vector instruction set the library was built for: avx512, avx2 or generic."""
    return library.kernel_isa().decode()
