"""Compile and load the engine's optional C kernels (``*.c`` beside this file) with the system C compiler.

A library is built once per sources, flags and compiler into ``<data_dir>/kernels`` (a temporary folder when
that is not writable) and loaded with ctypes; later processes load the cached library in milliseconds.
Anything that goes wrong (no compiler, a CPU without AVX2/FMA, a failed build) is logged and yields None:
the engine then uses plain PyTorch, which gives the same results, only slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
# -fopenmp links libgomp.so.1, the same soname as the copy torch ships and has already loaded, so the kernels
# share torch's OpenMP thread pool instead of starting a second one.
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_BUILD_TIMEOUT_S = 120


def cpu_supported() -> bool:
    """x86-64 with AVX2 and FMA (torch reports AVX2 or AVX512 only when both are there)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def find_compiler() -> str | None:
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def cache_dirs() -> list[Path]:
    """Where built libraries go: the settings' data dir first, then a per-user temporary folder."""
    dirs: list[Path] = []
    try:
        from app.settings import get_settings  # the one settings object, imported lazily

        dirs.append(Path(get_settings().data_dir).expanduser() / "kernels")
    except Exception as exc:  # invalid settings must not stop the engine: fall back to a temp dir
        log.debug("no settings data dir for kernels: %s", exc)
    dirs.append(Path(tempfile.gettempdir()) / f"inf-engine-kernels-{os.getuid()}")
    return dirs


def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.splitlines()[0] if done.stdout else ""


def _compile(compiler: str, sources: list[Path], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build under a unique name and rename: concurrent processes never load a half-written library.
    fd, tmp_name = tempfile.mkstemp(prefix=target.stem + "-", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        cmd = [compiler, *CFLAGS, *map(str, sources), "-o", str(tmp), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def load_kernel(name: str, sources: tuple[str, ...] | None = None) -> ctypes.CDLL | None:
    """The library ``name`` compiled from ``sources`` (default ``<name>.c``) beside this file, built on first
    use; None where it cannot be had."""
    if sys.platform != "linux" or not cpu_supported():
        log.info("C kernel %s not used: needs Linux on an x86-64 CPU with AVX2 and FMA", name)
        return None
    compiler = find_compiler()
    if compiler is None:
        log.warning("C kernel %s not used (PyTorch fallback): no C compiler (cc, gcc or clang) on PATH", name)
        return None
    paths = [SOURCE_DIR / src for src in (sources or (f"{name}.c",))]
    headers = sorted(SOURCE_DIR.glob("*.h"))  # included by the sources: part of what was built
    texts = [path.read_text(encoding="utf-8") for path in [*paths, *headers]]
    ident = "\0".join([*texts, *CFLAGS, _compiler_version(compiler)])
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    errors: list[str] = []
    for folder in cache_dirs():
        target = folder / f"{name}-{digest}.so"
        try:
            if not target.is_file():
                _compile(compiler, paths, target)
            return ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            errors.append(f"{folder}: {exc}")
    log.warning("C kernel %s not used (PyTorch fallback): %s", name, "; ".join(errors))
    return None
