"""The engine's C kernels for CPUs (layers/csrc/*.c), built with the machine's compiler the first
time an engine needs them, cached, and loaded through ctypes.

One shared library holds them all: decode and prefill attention over the paged pool
(paged_decode.c, prefill_attention.c), small-M matmuls whose weights stream at the memory's speed (small_matmul.c) and the whole-model decode
step (decode_step.c), and greedy speculative decoding's draft-and-verify cycles built on it
(speculate.c). The instruction set is chosen at build time: `-march=native` gives
AVX-512 code on a CPU that has it and AVX2 code on one that does not (the sources switch on
`__AVX512F__`), and the library says which it got (`isa()`). Tests build the AVX2 variant on an
AVX-512 machine too (`extra_flags=ISA_FLAGS["avx2"]`), so both paths are checked wherever the
suite runs; PAGEDLLM_KERNEL_ISA=avx2 gives a whole engine that build, to measure the AVX2 path's
speed where no AVX2-only CPU is at hand.

The build is keyed by a hash of the sources, the flags, the compiler and the CPU's feature flags
(-march=native code is only valid on CPUs with the same instruction sets) and cached in the
user's cache, `$PAGEDLLM_CACHE_DIR/kernels`, else `$XDG_CACHE_HOME/pagedllm/kernels` or
`~/.cache/pagedllm/kernels`, or, where that cannot be written (a read-only or missing home), in a
folder of the user's own in the temp dir, made private before a library is built or loaded from
it (one another user could write to would let them put code into this process). Nothing is
written next to the installed package, so an install owned by root serves every user; concurrent
builders race harmlessly (atomic rename). Without a compiler, or if the build fails, `load()`
returns None after one clear warning and the engine runs its PyTorch paths.

What Python sees of the library — its structs, functions and status codes — is declared once, in
csrc/interface.h, and read from there (layers/kernel_interface.py); the build adds the table of
struct layouts the loader checks against.

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
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedllm.layers import kernel_interface

logger = logging.getLogger("pagedllm.kernels")

_CSRC = Path(__file__).with_name("csrc")
SOURCES = ("checks.c", "paged_decode.c", "prefill_attention.c", "small_matmul.c", "amx_int8.c", "decode_step.c", "greedy.c",
           "nucleus.c", "categorical.c", "speculate.c")
HEADERS = ("interface.h", "kernels.h", "decode_step.h")
LAYOUT_SOURCE = "layout.c"  # generated at build time (kernel_interface.layout_source)
# -ffast-math (but keeping infinities) lets the reductions and exp vectorise. It is given to the
# compile step only: linked with it, gcc adds crtfastmath.o, whose constructor switches the whole
# process to flush-denormals-to-zero when the library loads.
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-fPIC", "-std=gnu11")
_LINK_FLAGS = ("-shared", "-fopenmp", "-lm")
# The streamed weights' software prefetch (small_matmul.c, STREAM_*) per CPU family (cpu_family):
# an Intel Xeon streams from L2 prefetches 4 KB ahead (a non-temporal prefetch fills L1 alone and
# does not train its L2 streamer), and so does a Zen 3 EPYC (-3 to -5 % a single-stream step); a
# Zen 5 measured the same within its spread with either, and Zen 2 and Zen 4 were never measured, so
# they keep the sources' defaults, a non-temporal prefetch 1 KB ahead. docs/engine.md, "Prefetch hints".
L2_4KB = ("-DSTREAM_LOCALITY=2", "-DSTREAM_AHEAD_BYTES=4096")
STREAM_HINTS = {"Intel": L2_4KB, "Zen 3": L2_4KB}
# The sanitizer build: every access checked (ASan), undefined behaviour fatal (UBSan), frames
# kept for readable reports. Still -O3, the code the engine runs: at -O1 the unvectorised sums
# round differently and the kernels' tolerance tests fail (it would compile in 5 s, not 20 s).
# Given to the link too, which then pulls in the UBSan runtime.
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g")
SANITIZE_ENV = "PAGEDLLM_SANITIZE"
# The statuses of csrc/interface.h.
STATUSES = kernel_interface.STATUSES
KERNEL_OK, KERNEL_NO_MEMORY = STATUSES["KERNEL_OK"], STATUSES["KERNEL_NO_MEMORY"]
KERNEL_BAD_SHAPE, KERNEL_REFUSED = STATUSES["KERNEL_BAD_SHAPE"], STATUSES["KERNEL_REFUSED"]
NO_COMPILER_MESSAGE = (
    "no C compiler found (looked for gcc, cc, clang): the CPU kernels (decode attention, small-batch "
    "matmuls, the fused decode step) are disabled and the engine falls back to its PyTorch path, "
    "which is several times slower at small batches; install gcc to enable them"
)

_libraries: dict[tuple[str, ...], ctypes.CDLL | None] = {}


def compiler() -> str | None:
    return next((found for cc in ("gcc", "cc", "clang") if (found := shutil.which(cc))), None)


def cache_dirs() -> list[tuple[Path, bool]]:
    """Where a build may be kept, in order, each with whether it lies in a shared place and must
    be made private: the user's cache (see the module's doc), then the temp dir's folder."""
    root = os.environ.get("PAGEDLLM_CACHE_DIR") or _user_cache()
    folders = [(Path(root) / "kernels", False)] if root else []
    return folders + [(Path(tempfile.gettempdir()) / f"pagedllm-{os.getuid()}" / "kernels", True)]


def _user_cache() -> str | None:
    """$XDG_CACHE_HOME/pagedllm (an absolute one), else ~/.cache/pagedllm; None without a home
    ("~" then stays relative)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    cache = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "pagedllm") if os.path.isabs(cache) else None


def _prepare(folder: Path, private: bool) -> None:
    """Creates `folder`; a private one (and its parent, the user's folder in the temp dir) must
    belong to this user, and is made readable and writable by this user alone."""
    folder.mkdir(parents=True, exist_ok=True)
    if private:
        for owned in (folder.parent, folder):
            if owned.stat().st_uid != os.getuid():
                raise PermissionError(f"{owned} belongs to another user")
            os.chmod(owned, 0o700)


def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo, "" where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == field), "")


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), "" where there is none."""
    return _cpuinfo("vendor_id")


def cpu_model() -> str:
    """/proc/cpuinfo's model name with its family and model numbers (benchmarks print it beside their
    figures; a VM may name only "AMD EPYC": the family and model tell the generation, cpu_family)."""
    name, family, model = _cpuinfo("model name"), _cpuinfo("cpu family"), _cpuinfo("model")
    return f"{name} (family {family}, model {model}; {cpu_family()})" if family else name


# AMD's families and the models each Zen generation took in them (AMD's processor programming
# references): family 0x17 from model 0x30 is Zen 2, family 0x19 is Zen 3 or Zen 4 by model, 0x1a Zen 5.
_ZEN_4_MODELS = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))


def cpu_family() -> str:
    """The family the kernels' build is tuned for: "Intel", "Zen 2" to "Zen 5", else the vendor
    ("" where /proc/cpuinfo names none)."""
    vendor = cpu_vendor()
    if vendor == "GenuineIntel":
        return "Intel"
    try:
        family, model = int(_cpuinfo("cpu family")), int(_cpuinfo("model"))
    except ValueError:
        return vendor
    if vendor != "AuthenticAMD" or family < 0x17:
        return vendor
    if family == 0x17:
        return "Zen 2" if model >= 0x30 else "Zen"
    if family == 0x19:
        return "Zen 4" if any(model in models for models in _ZEN_4_MODELS) else "Zen 3"
    return "Zen 5" if family == 0x1A else vendor


def _cpu_signature() -> bytes:
    try:
        flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
        return flags[0].encode() if flags else b""
    except OSError:
        return b""


def prefetch_hint() -> str:
    """The streamed weights' software prefetch this CPU family's build uses (STREAM_HINTS), in words."""
    family = cpu_family()
    flags = dict(flag.removeprefix("-D").split("=") for flag in STREAM_HINTS.get(family, ()))
    locality = int(flags.get("STREAM_LOCALITY", 0))
    ahead = int(flags.get("STREAM_AHEAD_BYTES", 1024))
    where = {0: "non-temporal", 1: "into L3", 2: "into L2", 3: "into L1"}[locality]
    return f"{where}, {ahead} bytes ahead ({family or 'unknown CPU'})"


ISA_ENV = "PAGEDLLM_KERNEL_ISA"
# What PAGEDLLM_KERNEL_ISA=avx2 takes away from -march=native: an AVX-512 machine then builds the
# code an AVX2-only CPU (AMD Zen 2/3, Intel before Ice Lake) gets, to measure and tune that path
# where no such CPU is at hand. AVX-VNNI (VEX-encoded, Zen 4+/Alder Lake+) and AMX go too: the
# CPUs this stands for have neither.
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f", "-mno-avxvnni", "-mno-amx-tile")}


def isa_flags() -> tuple[str, ...]:
    """The flags PAGEDLLM_KERNEL_ISA asks for (unset or "native": none)."""
    choice = os.environ.get(ISA_ENV, "native")
    if choice not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={choice!r}: expected one of {', '.join(ISA_FLAGS)}")
    return ISA_FLAGS[choice]


def build(cc: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the sources once per (sources, flags, compiler, CPU) into the cache; the path of
    the shared library."""
    flags = (*_FLAGS, *STREAM_HINTS.get(cpu_family(), ()), *isa_flags(), *extra_flags)
    layout = kernel_interface.layout_source()
    digest = hashlib.sha256(" ".join([cc, *flags, *_LINK_FLAGS]).encode() + _cpu_signature() + layout.encode())
    for name in (*HEADERS, *SOURCES):
        digest.update((_CSRC / name).read_bytes())
    name = f"pagedllm_kernels-{digest.hexdigest()[:16]}.so"
    failures = []
    for folder, private in cache_dirs():
        target = folder / name
        try:
            _prepare(folder, private)
            if target.exists():
                return target
            _compile(cc, flags, extra_flags, layout, folder, target)
            return target
        except OSError as exc:  # not writable, read-only, full: the next folder
            failures.append(f"{folder}: {exc}")
    raise OSError("no writable folder for the compiled CPU kernels (" + "; ".join(failures) + ")")


def _compile(cc: str, flags: tuple[str, ...], extra_flags: tuple[str, ...], layout: str, folder: Path, target: Path) -> None:
    logger.info("building the CPU kernels for this machine (once) from %s into %s", _CSRC, folder)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        (Path(tmp) / LAYOUT_SOURCE).write_text(layout)
        sources = sorted((*(_CSRC / s for s in SOURCES), Path(tmp) / LAYOUT_SOURCE), key=lambda s: -s.stat().st_size)
        objects = [str(Path(tmp) / source.name.replace(".c", ".o")) for source in sources]
        _compile_objects(cc, flags, sources, objects)
        built = Path(tmp) / target.name
        subprocess.run([cc, *objects, "-o", str(built), *_LINK_FLAGS, *extra_flags], check=True, capture_output=True, text=True)
        os.replace(built, target)
    logger.info("built the CPU kernels in %.1f s", time.perf_counter() - started)


def _compile_objects(cc: str, flags: tuple[str, ...], sources: list[Path], objects: list[str]) -> None:
    """Compile each source to its object, as many at once as this process may use cores: the
    sanitizer build spends ~35 s in small_matmul.c alone and ~60 s in all of them on one core, so
    the largest sources go first and the rest fill the other cores meanwhile. The first failure
    is raised (CalledProcessError, with the compiler's stderr)."""
    def compile_one(pair: tuple[Path, str]) -> None:
        source, obj = pair
        subprocess.run([cc, *flags, f"-I{_CSRC}", "-c", str(source), "-o", obj], check=True, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=max(1, len(os.sched_getaffinity(0)))) as pool:
        list(pool.map(compile_one, zip(sources, objects)))


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
    # libstdc++ right after it: ASan's __cxa_throw interceptor finds the real one only if libstdc++
    # is loaded when ASan starts; otherwise the first C++ exception a library throws and catches
    # itself (torchao registering its ops, imported by transformers) aborts in a CHECK
    preload = [runtime]
    cxx = subprocess.run([cc, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True).stdout.strip()
    if os.path.isabs(cxx):
        preload.append(os.path.realpath(cxx))
    return {
        SANITIZE_ENV: "1",
        "LD_PRELOAD": " ".join(preload),
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
        path = build(cc, extra_flags)
        library = kernel_interface.open_library(path)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the CPU kernels failed (%s); the engine falls back to its PyTorch path", detail)
        return None
    logger.info("CPU kernels: the %s build (%s), int8 dot products: %s, streamed weights' prefetch: %s; at %s", isa(library),
                os.environ.get(ISA_ENV, "native"), library.int8_dot_product().decode(), prefetch_hint(), path)
    return library


class KernelRefused(RuntimeError):
    """A kernel refused its arguments: a size or index outside the buffers its caller described.
    The engine's own invariant broke (the kernels are only called with metadata it built), so
    this is a bug to report, not a user error; nothing was written."""


def check_status(status: int, library: ctypes.CDLL, kernel: str, head_dim: int | None = None) -> None:
    """The exception a kernel's nonzero status stands for (every kernel's wrapper calls this);
    each status of interface.h has its exception here (a test holds every one to it)."""
    if status == KERNEL_OK:
        return
    if status == KERNEL_NO_MEMORY:
        raise MemoryError(f"{kernel} kernel: out of memory for its scratch space")
    if status == KERNEL_BAD_SHAPE:
        detail = f", got {head_dim}" if head_dim is not None else ""
        raise ValueError(f"{kernel} kernel: head_dim must be a multiple of 8 and heads a multiple of KV heads{detail}")
    if status == KERNEL_REFUSED:
        raise KernelRefused(f"{kernel} kernel refused its arguments: {library.kernel_last_error().decode(errors='replace')}")
    raise RuntimeError(f"{kernel} kernel: status {status}, not one of interface.h's")


def isa(library: ctypes.CDLL) -> str:
    """The vector instruction set the library was built for: avx512, avx2 or generic."""
    return library.kernel_isa().decode()
