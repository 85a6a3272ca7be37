"""The offload-process transport: a CPU process computes each step's PLE rows, GPU streams wait for them.

* ``shared_memory`` -- ``SharedHostBuffer``: page-locked host memory two processes map.
* ``control``       -- ``ControlBlock``: the shared words both processes use (steps, flags,
                       waiting words), and the named messages of their pipe.
* ``worker``        -- the offload process: the handshake, then the serving loop.
* ``process``       -- ``WorkerProcess``: that process seen from the GPU process (start,
                       handshake, liveness, fatal failure, stop); ``OffloadError``.
* ``transaction``   -- ``StepTransaction``: prepare, the ops' step guard, release.
* ``watchdog``      -- ``Watchdog``: the thread that frees GPU streams no prepared step will
                       serve, and fails the runtime (a dead process, a late step).
* ``offload``       -- ``OffloadRuntime``: the public facade over the three.
* ``multiprocessing_internals`` -- the one reach into multiprocessing's private names (whether
                       the process's exit status was collected).
"""

from .offload import OffloadRuntime
from .process import OffloadError

__all__ = ["OffloadRuntime", "OffloadError"]
