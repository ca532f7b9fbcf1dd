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

Every exported kernel checks the sizes and indices it is given against the capacities its
wrapper passes and refuses with a status rather than read or write past a buffer
(csrc/checks.c); `check_status` turns a status into the exception. A process started with
PAGEDLLM_SANITIZE=1 (and the ASan runtime preloaded, `sanitizer_env()`) gets every build with
AddressSanitizer and UndefinedBehaviorSanitizer (`SANITIZE_FLAGS`): the sanitizer test job
(tests/layers/test_sanitizers.py) and the soak's crash hunt run the kernels that way. It is an
environment variable rather than an engine setting because it is a property of the process — the
runtime must be loaded before anything else — not of one engine.
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
SOURCES = ("checks.c", "paged_decode.c", "prefill_attention.c", "small_matmul.c", "decode_step.c", "greedy.c", "speculate.c")
HEADERS = ("kernels.h", "decode_step.h")
# -ffast-math (but keeping infinities) lets the reductions and exp vectorise. It is given to the
# compile step only: linked with it, gcc adds crtfastmath.o, whose constructor switches the whole
# process to flush-denormals-to-zero when the library loads.
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-fPIC", "-std=gnu11")
_LINK_FLAGS = ("-shared", "-fopenmp", "-lm")
# The sanitizer build: every access checked (ASan), undefined behaviour fatal (UBSan), frames
# kept for readable reports. Still -O3, the code the engine runs: at -O1 the unvectorised sums
# round differently and the kernels' tolerance tests fail (it would compile in 5 s, not 20 s).
# Given to the link too, which then pulls in the UBSan runtime.
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g")
SANITIZE_ENV = "PAGEDLLM_SANITIZE"
# The statuses of csrc/kernels.h.
KERNEL_OK, KERNEL_NO_MEMORY, KERNEL_BAD_SHAPE, KERNEL_REFUSED = 0, 1, 2, 4
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
                subprocess.run([cc, *objects, "-o", str(built), *_LINK_FLAGS, *extra_flags], check=True, capture_output=True,
                               text=True)
                os.replace(built, target)
            return target
        except PermissionError:
            continue
    raise OSError("no writable folder for the compiled CPU kernels")


def load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel library built with `extra_flags` (and the sanitizers, in a process started for
    them), built on first use; None (with one warning) if it cannot be built."""
    if extra_flags not in _libraries:
        _libraries[extra_flags] = _load(extra_flags + (SANITIZE_FLAGS if sanitizing() else ()))
    return _libraries[extra_flags]


def sanitizing() -> bool:
    """Whether this process builds its kernels with the sanitizers (PAGEDLLM_SANITIZE=1)."""
    return os.environ.get(SANITIZE_ENV) == "1"


def sanitizer_env(cc: str | None = None) -> dict[str, str]:
    """The environment a child process needs to run sanitized kernels: the ASan runtime
    preloaded (it must come before every other library, and python is not built with it),
    reports that end the process, and leak checking off (the interpreter's own allocations are
    never freed)."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError(NO_COMPILER_MESSAGE)
    runtime = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True, check=True).stdout.strip()
    if not os.path.isabs(runtime):
        raise RuntimeError(f"{cc} has no AddressSanitizer runtime (libasan.so)")
    return {
        SANITIZE_ENV: "1",
        "LD_PRELOAD": runtime,
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    }


def sanitizer_available() -> bool:
    """Whether this machine's compiler has the ASan runtime the sanitizer build needs (gcc's)."""
    try:
        sanitizer_env()
    except (RuntimeError, OSError, subprocess.CalledProcessError):
        return False
    return True


def _load(extra_flags: tuple[str, ...]) -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        logger.warning(NO_COMPILER_MESSAGE)
        return None
    if "-fsanitize=address,undefined" in extra_flags and "libasan" not in Path("/proc/self/maps").read_text():
        raise RuntimeError("a sanitizer build of the kernels needs the ASan runtime preloaded (kernels.sanitizer_env())")
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
    library.paged_decode_f32.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64] + [i64] * 7 + [f32, i32]
    library.prefill_attention_f32.restype = i32
    library.prefill_attention_f32.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64, i64, ptr, i64, i64] + [i64] * 5 + [f32, i32]
    library.kernel_isa.restype = ctypes.c_char_p
    library.kernel_isa.argtypes = []
    library.kernel_last_error.restype = ctypes.c_char_p
    library.kernel_last_error.argtypes = []
    library.panel_width.restype = i64
    library.panel_width.argtypes = []
    library.small_matmul.restype = i32
    library.small_matmul.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64, i64, i32, i32]
    library.decode_step.restype = i32
    library.decode_step.argtypes = [ptr, ptr, i32]
    library.decode_steps.restype = i32
    library.decode_steps.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ptr, i64]
    library.speculate_greedy.restype = i32
    library.speculate_greedy.argtypes = [ptr, ptr, ptr, i64, ptr, ptr]
    library.read_bandwidth.restype = ctypes.c_double
    library.read_bandwidth.argtypes = [ptr, i64, i32, i32]
    library.greedy_rows.restype = i32
    library.greedy_rows.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64]


class KernelRefused(RuntimeError):
    """A kernel refused its arguments: a size or index outside the buffers its caller described.
    The engine's own invariant broke (the kernels are only called with metadata it built), so
    this is a bug to report, not a user error; nothing was written."""


def check_status(status: int, library: ctypes.CDLL, kernel: str, head_dim: int | None = None) -> None:
    """The exception a kernel's nonzero status stands for (every kernel's wrapper calls this)."""
    if status == KERNEL_OK:
        return
    if status == KERNEL_NO_MEMORY:
        raise MemoryError(f"{kernel} kernel: out of memory for its scratch space")
    if status == KERNEL_BAD_SHAPE:
        detail = f", got {head_dim}" if head_dim is not None else ""
        raise ValueError(f"{kernel} kernel: head_dim must be a multiple of 8 and heads a multiple of KV heads{detail}")
    if status == KERNEL_REFUSED:
        raise KernelRefused(f"{kernel} kernel refused its arguments: {library.kernel_last_error().decode(errors='replace')}")
    raise RuntimeError(f"{kernel} kernel: unknown status {status}")


def isa(library: ctypes.CDLL) -> str:
    """The vector instruction set the library was built for: avx512, avx2 or generic."""
    return library.kernel_isa().decode()
