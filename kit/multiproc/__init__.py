"""Several processes from a running notebook: ``session.train(processes=N)``.

N worker processes, started by spawning (so CUDA initialised in the kernel does not matter), train
the session's loop as torchrun's ranks would (gloo on the CPU, NCCL on CUDA, the data split as under
torchrun); their events reach the session live, Pause stops every rank at the same step, and the
whole training state comes home when a call returns. See ``docs/processes.md``.
"""

from kit.multiproc.driver import close, rank_status, startup_secs, worker_pids
from kit.multiproc.pool import status_lines
from kit.multiproc.wire import RankStatus, RemoteTraceback, WorkerError

__all__ = ["RankStatus", "RemoteTraceback", "WorkerError", "close", "rank_status", "startup_secs", "status_lines",
           "worker_pids"]
