"""A deadline for Python code that cannot be trusted to finish: a chat template is a program
(Jinja), and two nested 100,000-iteration loops in one held a model's requests forever and kept a
thread at 95 % CPU after the model was unloaded.

Jinja's sandbox forbids unsafe attribute access but not unbounded work, and a thread cannot be
killed from outside. What Python does offer is an exception raised in another thread at its next
bytecode (`PyThreadState_SetAsyncExc`): a template renders as Python bytecode, so a timer that
raises `DeadlineExceeded` in the rendering thread stops it where it is. Work inside one C call
(a single huge string operation) finishes that call first; every loop is interruptible."""
from __future__ import annotations

import ctypes
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


class DeadlineExceeded(Exception):
    """Raised inside the thread whose call ran past its deadline."""


def call_with_deadline(seconds: float, fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs), or DeadlineExceeded once it has run `seconds`."""
    thread_id = threading.get_ident()
    lock = threading.Lock()
    running = [True]

    def expire() -> None:
        with lock:  # never raise into the thread once the call has returned
            if running[0]:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(DeadlineExceeded))

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        try:
            return fn(*args, **kwargs)
        finally:
            with lock:
                running[0] = False
            timer.cancel()
    except DeadlineExceeded:
        # raised at the deadline (possibly as the call was returning, while the lock was taken)
        raise DeadlineExceeded(f"did not finish within {seconds:g} s") from None
