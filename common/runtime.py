"""Process-wide runtime defaults. Import and call `configure()` before torch is imported."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import sys
import typing
from concurrent.futures import ThreadPoolExecutor

# About 0.1-0.3 ms of spinning: longer than the gap between two ops of a step, far shorter
# than a step or a network wait.
SHORT_SPIN = "10000"
_spin_defaulted = False  # configure() chose the short spin: the user set nothing


def configure(shares_cores: bool = False) -> None:
    """How idle OpenMP threads wait, unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is already set.

    A process with the cores to itself spins briefly after each parallel op: a step runs
    hundreds of small ops, and waking a sleeping thread for each one can cost more than the
    second thread gains (small preset, 2 cores, bfloat16, 32 sequences on two threads: 1060
    tok/s spinning briefly vs 634 sleeping at once; transformers' generate at batch 1: 75-80 vs
    30-50 tok/s).

    Processes that share cores (`shares_cores`, or `moe-mesh up` and the test suite, which start
    a router and expert services on one host) sleep at once: a spinning thread then steals the
    core another process computes on (measured on 2 cores: 32-token dispatch p50 118 ms
    spinning vs 23 ms passive; a single engine next to a busy process fell from 70 to 12 tok/s).
    """
    global _spin_defaulted
    # gRPC core's own log lines ("E0000 ... Failed to add port") repeat what our one-line errors
    # say; GRPC_VERBOSITY=ERROR (or INFO, DEBUG) brings them back.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    if shares_cores:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        os.environ["GOMP_SPINCOUNT"] = SHORT_SPIN
        _spin_defaulted = True


def shared_cores_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child process that will share this host's cores with its siblings."""
    env = dict(env)
    if _spin_defaulted:
        env.pop("GOMP_SPINCOUNT", None)
    if "GOMP_SPINCOUNT" not in env:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def release_openmp_threads(serial: bool = False) -> None:
    """End the OpenMP worker threads of the calling thread; with `serial`, its later torch ops
    run on it alone, so it never starts workers again. A service calls this on its main thread
    once the model is loaded, leaving parallel work to its compute thread.

    libgomp keeps a team of workers for every thread that ran a parallel op, and once it manages
    more threads than the host has cores it lets an idle worker spin 100 times, not
    GOMP_SPINCOUNT, before it sleeps: each parallel op then waits for workers to wake. A process
    that loaded on its main thread and computes on another has two teams (measured, 2 cores, small
    preset, monolithic engine: bfloat16 batch 1 53 -> 69 tok/s, float32 batch 8 106 -> 131).
    Without libgomp (another OpenMP, or none) this does nothing."""
    lib = _libgomp()
    if lib is None:
        return
    lib.omp_pause_resource_all(1)  # omp_pause_soft: this thread's pool only (libgomp)
    if serial:
        import torch

        torch.set_num_threads(1)  # this thread's OpenMP and MKL; threads started later too


def freeze_heap() -> None:
    """Exempt everything alive now (imports, the loaded model) from the garbage collector. A
    service calls it once loaded: a full collection of a process that imported torch walks
    ~220k objects, 0.2 s of the event loop's time each (AMD EPYC, 2 cores), paid again at
    every later full collection although none of those objects will ever be garbage."""
    gc.collect()
    gc.freeze()


def exit_now(code: int | None) -> typing.NoReturn:
    """Exit with `code` (as sys.exit would) without the interpreter's teardown: after importing
    torch it collects and frees module by module for 1.0-1.4 s of a core (AMD EPYC, 2 cores),
    which every stop and every command waited for. Whoever calls this has done its own cleanup
    (servers stopped, spans flushed, files closed); only logging and stdio are flushed here."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a reader that went away (`| head`)
            pass
    os._exit(code if isinstance(code, int) else 0)


def return_freed_heap() -> None:
    """Hand the freed heap glibc keeps back to the system (malloc_trim): a load's temporaries
    leave it behind (an engine built at the Mixtral-8x7B slice kept 90 MiB of them; the Qwen3
    slice's, closed and collected, 6.5 GB). Elsewhere than glibc its allocator decides."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def compute_thread(name: str) -> ThreadPoolExecutor:
    """One thread for a service's torch work, computing with as many threads as the caller has
    now: a new thread would otherwise take torch's latest setting (1 after a serial pass)."""
    import torch

    return ThreadPoolExecutor(
        1,
        thread_name_prefix=name,
        initializer=torch.set_num_threads,
        initargs=(torch.get_num_threads(),),
    )


_gomp: ctypes.CDLL | None = None


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp that torch loaded, if it did."""
    global _gomp
    if _gomp is None:
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "/libgomp" in line}
        except OSError:
            return None
        if len(paths) == 1:
            _gomp = ctypes.CDLL(paths.pop())
    return _gomp


# Set by a launcher on the services it starts: they must not outlive it, however it ends.
PARENT_PID_ENV = "MOE_MESH_PARENT_PID"
WATCHDOG_PERIOD_S = 0.25


def die_with_parent() -> None:
    """End this process within WATCHDOG_PERIOD_S once the launcher named by MOE_MESH_PARENT_PID is gone.

    Signal handlers cannot do this: a launcher killed with SIGKILL runs none. Linux's parent-death
    signal (PR_SET_PDEATHSIG) fires when the *thread* that started the child exits, and a launcher
    starts children from worker threads (`moe-mesh scale`), so a thread watches instead: when the
    parent dies the child is re-parented, and getppid() changes. It runs beside model loading too.
    The launcher's registry died with it, so there is nothing to drain towards: the end is SIGKILL.
    """
    expected = os.environ.get(PARENT_PID_ENV)
    if not expected:
        return
    import signal
    import threading
    import time

    def watch() -> None:
        while os.getppid() == int(expected):
            time.sleep(WATCHDOG_PERIOD_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
