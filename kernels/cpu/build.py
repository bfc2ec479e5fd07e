"""Compile the native CPU kernels on first use and load them with ctypes.

The C++ sources of this folder are compiled into one shared library with the system's
``g++`` against torch's own headers and libraries (ATen's ``parallel_for`` runs on torch's
OpenMP threads, so the kernels share torch's thread pool instead of competing with it).
The library is cached under ``$LAMINA_HOME/kernels/`` by a hash of the sources, the flags
and the torch version, and is written atomically, so concurrent workers on one machine
compile at most once each and never load a half-written file. Instruction-set flags
follow torch's own CPU capability (AVX2 or AVX-512), not ``-march=native``, so a cache
shared between machines stays valid.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from lamina.libs.config import lamina_home

log = logging.getLogger("lamina.kernels")

_HERE = Path(__file__).parent
SOURCES = sorted(_HERE.glob("*.cpp"))
HEADERS = sorted(_HERE.glob("*.h"))
_ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"],
}


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer for a kernel argument (None passes NULL)."""
    return None if t is None else t.data_ptr()


_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES: dict[str, tuple[list, object]] = {
    # name: (argument types, return type), as the sources' extern "C" declarations say.
    "lamina_rms_norm": ([_P, _I64, _P, _I64, _P, _F32, _I64, _I64, _P, _P, ctypes.c_int], None),
    "lamina_silu_and_mul": ([_P, _I64, _I64, _P, ctypes.c_int], None),
    "lamina_lora_bgmv": ([_P, _I64, _P, _I64, _I64, _I64, _P, _P, _I64, _I64, _P], None),
    "lamina_rotary": ([_P, _I64, _P, _P, _I64, _I64, _I64, _P, ctypes.c_int], None),
    "lamina_pack_weight": ([_P, _I64, _I64, _P], None),
    "lamina_packed_linear": ([_P, _I64, _I64, _I64, _P, _I64, _P, _P], None),
    "lamina_packed_silu_mul": ([_P, _I64, _I64, _I64, _P, _I64, _P, _P], None),
    "lamina_pack_weight_bytes": ([_P, _I64, _I64, _P], None),
    "lamina_pack_weight_halves": ([_P, _I64, _I64, _P], None),
    "lamina_pack_weight_int4": ([_P, _I64, _I64, _P], None),
    "lamina_pack_weight_pairs": ([_P, _I64, _I64, _P], None),
    "lamina_bf16_linear": (
        [_P, _I64, _I64, _I64, _P, _I64, _P, _P, ctypes.c_int, ctypes.c_int],
        None,
    ),
    "lamina_packed_linear_q": (
        [_P, _I64, _I64, _I64, _P, ctypes.c_int, _P, _P, _I64, _I64, _P, _P],
        None,
    ),
    "lamina_packed_silu_mul_q": (
        [_P, _I64, _I64, _I64, _P, ctypes.c_int, _P, _P, _I64, _I64, _P, _P],
        None,
    ),
    "lamina_decode_logits": (
        [_P, _I64, _P, ctypes.c_int, _F32, _F32, _I64, *[_P] * 9, _I64, _P, _P, _P, _P, _P],
        ctypes.c_int,
    ),
    "lamina_decode_work_bytes": ([_I64, _P, ctypes.c_int], _I64),
    "lamina_shm_allreduce_bytes": ([_I64, _I64], _I64),
    "lamina_shm_allreduce_attach": ([_P, _I64, _I64], None),
    "lamina_shm_allreduce": (
        [_P, _I64, _I64, _I64, _P, _I64, ctypes.c_int, _I64, ctypes.c_double],
        ctypes.c_int,
    ),
    "lamina_paged_decode_attention": (
        [_P, _I64, _P, ctypes.c_int, _P, _P, _I64, _P, *[_I64] * 6, _F32, _P, *[ctypes.c_int] * 2],
        ctypes.c_int,
    ),
}
"""Declared once at load, so that calls pass plain Python ints and floats (ctypes converts
them) instead of building a ctypes object per argument, which on small calls costs as
much as the kernel."""


class BuildError(RuntimeError):
    """The native kernels could not be compiled or loaded (the message says why)."""


def _isa_flags() -> list[str]:
    return _ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability().split()[0], [])


def vectorized() -> bool:
    """Whether the kernels are built with AVX2 (or AVX-512) intrinsics; elsewhere they are
    plain C++, correct but without their hand-written SIMD paths."""
    return bool(_isa_flags())


def _command(sources: list[Path], output: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    isa = _isa_flags()
    return [
        os.environ.get("CXX", "g++"),
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fopenmp",
        "-ffp-contract=fast",
        "-fno-math-errno",
        *isa,
        "-D_GLIBCXX_USE_CXX11_ABI=" + str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
        f"-I{torch_dir / 'include'}",
        *map(str, sources),
        "-o",
        str(output),
        f"-L{torch_dir / 'lib'}",
        "-ltorch_cpu",
        "-lc10",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]


@functools.cache
def load_library() -> ctypes.CDLL:
    """The compiled kernels (built now if the cache lacks them); :class:`BuildError` if
    there is no compiler or the build fails."""
    digest = hashlib.sha256(" ".join(_command(SOURCES, Path("out.so"))).encode())
    digest.update(torch.__version__.encode())
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    key = digest.hexdigest()[:16]
    target = lamina_home() / "kernels" / f"cpu-{key}.so"
    if not target.exists():
        _compile(target)
    try:
        library = ctypes.CDLL(str(target))
    except OSError as exc:
        raise BuildError(f"cannot load {target}: {exc}") from exc
    for name, (argtypes, restype) in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    return library


def _compile(target: Path) -> None:
    compiler = _command(SOURCES, target)[0]
    if shutil.which(compiler) is None:
        raise BuildError(f"no C++ compiler ({compiler!r} not found; set CXX)")
    target.parent.mkdir(parents=True, exist_ok=True)
    log.warning("compiling the native CPU kernels (the first run only: about half a minute)")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        result = subprocess.run(
            _command(SOURCES, partial), capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise BuildError(f"compiling the CPU kernels failed:\n{result.stderr[-4000:]}")
        os.replace(partial, target)  # atomic: a concurrent loader sees all of it or nothing
    log.info("compiled native CPU kernels to %s", target)
