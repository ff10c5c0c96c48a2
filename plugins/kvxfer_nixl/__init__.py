"""kvxfer's NIXL backend: ``pip install 'kvxfer[nixl]'``, then ``Agent(name, backend="nixl")``.

This module registers the backend and imports nothing heavy: ``nixl`` is imported from
:mod:`kvxfer_nixl.backend` only when an agent first uses it, so ``kvxfer backends`` on a
machine without NIXL lists it as unavailable, with the install command, instead of failing.
It is shaped like any third-party plugin (entry point ``nixl = "kvxfer_nixl"`` in the
``kvxfer`` group) and uses only kvxfer's public API.

What the backend does, and why
------------------------------
Measured on 2 x H200 (NVLink), decode READing a 7.0 GB request of a 61-layer MLA model as
1,563 whole rows: raw NIXL 289 GB/s, kvxfer over NIXL 286 GB/s (0.99x); one GPU, two
processes: 561 against 604 GB/s. The backend's own cost per transfer (post + poll + release)
is within 1-4 us of calling NIXL directly.

The fast path and nothing slower:

* **Register once.** All allocations of a kind go to ``register_memory`` in one N x 3 array,
  validated first (NIXL logs bad input and then raises an unhelpful ``TypeError``).
* **Prepare once, as strided rows.** The core hands ``prepare`` an N x 5 strided list
  (``strided_lists=True``) and it goes to ``prep_xfer_dlist`` unexpanded: on NIXL 1.5,
  262,144 blocks prepared as 32 strided rows took 0.22 ms against 48 ms as N x 3 rows.
  Local lists use ``"NIXL_INIT_AGENT"``, remote lists the peer's name.
* **One call per transfer.** ``post`` is ``make_prepped_xfer`` plus ``transfer``, with
  **numpy int32** index arrays: NIXL converts Python lists 10-15x slower (the planner emits
  int32 already; anything else is converted once, with a range check). NIXL merges runs of
  consecutive indices itself (``merges_runs=True``), so the core does not coalesce and
  never re-prepares lists per transfer (``cheap_prepare=False``: ``initialize_xfer`` costs
  0.8-4.8 ms at 16k descriptors).
* **Poll until DONE.** NIXL sends a transfer's notification only when the initiator polls
  it. Transfers that carry a notification are therefore also polled by a small helper
  thread (sleeping, never spinning) that lives only while one is pending, so a prefill
  worker that posts a WRITE and goes back to work still notifies decode
  (``notify_thread=False`` turns it off).
* **Typed errors.** Every NIXL exception becomes a kvxfer error: a disconnect is
  :class:`~kvxfer.PeerDisconnectedError`, a removed or restarted peer
  :class:`~kvxfer.StalePeerError`, unsupported features :class:`~kvxfer.UnsupportedError`,
  the rest :class:`~kvxfer.BackendError` with NIXL's message kept as the cause.
* **Restarts.** ``add_remote`` of a known name removes the old agent first (NIXL refuses a
  second load with ``nixlNotAllowedError``) and bumps an epoch, so lists prepared for the
  old incarnation raise :class:`~kvxfer.StalePeerError` instead of reaching stale memory.

Progress thread (option ``progress_thread``, default **off**)
------------------------------------------------------------
NIXL's progress thread busy-spins a whole core (the Python wrapper sets its delay to 0).
Measured with ``benchmarks/bench_nixl.py`` (details in ``benchmarks/BENCHMARKS.md (NIXL section)``):

* 2-core CPU box, DRAM, two processes, 256 x 4.5 MB rows: 5.9 GB/s without the thread,
  1.8 GB/s with it (spinning threads starve the threads that move the bytes).
* 2 x H200 over NVLink, VRAM, two processes, 1,563 rows (7.0 GB): 286 GB/s without,
  204 GB/s with it.
* A READ over cuda_ipc needs no progress from the target at all: with prefill driving
  progress only every 50 ms the rate stayed at 285 GB/s.

So the thread is off by default. Without it both sides must drive progress: the initiator
does by polling, the target through ``Agent.progress()`` or ``Agent.notifications()``
(``capabilities.needs_progress`` tells the core so), and agents of one process progress
each other while they wait, because nobody else would. Turn it on
(``progress_thread=True``) for a target that cannot call ``progress()`` often and moves
bytes over TCP or shared memory.

VRAM peers of one host (option ``device_copy``, default on)
-----------------------------------------------------------
UCX's cuda_ipc tops out near 290 GB/s between two H200s (74 % of a torch peer copy), and two
agents of one process moved 0.3-0.4 GB/s because UCX did not use cuda_ipc between them. So
VRAM goes through the core's device path (:mod:`kvxfer.cuda`) wherever it applies: the
connection blob carries the path's export (CUDA IPC handles of every registered VRAM
allocation), ``add_remote`` lets the path decide the route and open the peer's handles once,
``prepare`` has it check and translate each list, and ``post`` becomes one batched copy on a
private stream. Notifications still go through NIXL once the copy's event has fired.
Different hosts, GPUs without peer access, handles that do not open, or lists outside what
the peer exported stay on NIXL; ``TransferStats.path`` says which one moved the bytes
(``"cuda-ipc"``, ``"same-process"`` or ``"nixl"``). DRAM stays on NIXL (shared memory is fast
there, and it keeps CI on the real transport). ``device_copy=False`` turns the path off.

Known limits
------------
* A WRITE into memory the target has deregistered still completes in NIXL: lifetimes and
  bounds are the core's job.
* Transfers do not wait for the caller's CUDA streams: synchronize before posting.
* NIXL's Python logger prints to stdout; unless ``NIXL_LOG_LEVEL`` is set, this backend
  keeps it at WARNING and moves it to stderr.
"""

from __future__ import annotations

from typing import Callable

from kvxfer.plugin import hookimpl

__all__ = ["kvxfer_register_backends"]


@hookimpl
def kvxfer_register_backends(register: Callable[..., None]) -> None:
    """Offer the ``nixl`` backend; its module is imported only when first used."""
    register(
        "nixl",
        "kvxfer_nixl.backend:NixlBackend",
        requires=("nixl",),
        install="pip install 'kvxfer[nixl]'",
        summary="NVIDIA NIXL (UCX: NVLink, RDMA, TCP, shared memory); DRAM and VRAM",
    )
