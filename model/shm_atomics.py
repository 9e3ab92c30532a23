"""Acquire loads and release stores of 64-bit words in memory that other processes map.

Python has no atomics, and a plain store into a shared mapping may become visible to another core before the data
written ahead of it (ARM, the Sparks' Grace cores, reorders stores; x86 does not). GCC's libatomic exports the
`__atomic_*` builtins as functions that take the memory order as an argument, so ctypes gets real
acquire / release instructions from the system's own library instead of hand-written assembly.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

ACQUIRE, RELEASE = 2, 3  # __ATOMIC_ACQUIRE, __ATOMIC_RELEASE (GCC's memory-order numbering)


@functools.cache
def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("atomic")
    if name is None:
        raise RuntimeError("the same-host collective needs GCC's libatomic (Debian / Ubuntu: apt install libatomic1)")
    lib = ctypes.CDLL(name)
    getattr(lib, "__atomic_load_8").argtypes = [ctypes.c_void_p, ctypes.c_int]
    getattr(lib, "__atomic_load_8").restype = ctypes.c_uint64
    getattr(lib, "__atomic_store_8").argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
    getattr(lib, "__atomic_store_8").restype = None
    getattr(lib, "__atomic_is_lock_free").argtypes = [ctypes.c_size_t, ctypes.c_void_p]
    getattr(lib, "__atomic_is_lock_free").restype = ctypes.c_bool
    return lib


def check_lock_free(address: int) -> None:
    """Refuse a word libatomic would guard with a lock: its locks are private to a process, so useless here."""
    if not getattr(_lib(), "__atomic_is_lock_free")(8, address):
        raise RuntimeError(f"64-bit atomics at {address:#x} are not lock-free on this machine")


def load_acquire(address: int) -> int:
    return getattr(_lib(), "__atomic_load_8")(address, ACQUIRE)


def store_release(address: int, value: int) -> None:
    getattr(_lib(), "__atomic_store_8")(address, value, RELEASE)
