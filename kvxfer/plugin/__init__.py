"""Writing a kvxfer backend plugin: the seam, the hook and the registry, in one package.

A backend moves bytes and nothing else. It registers allocations, publishes an opaque
connection blob, prepares descriptor lists and moves ``local[i] <-> remote[i]`` pairs of
them. Blocks, layers, bounds, deadlines, coalescing and whole-row packing are the core's
work (:mod:`kvxfer.agent`, :mod:`kvxfer.planner`), so every transport gets them the same.

1. Subclass :class:`Backend` (module :mod:`kvxfer.plugin.backend`, which states the
   contract method by method) and declare its :class:`Capabilities`.
2. Offer it from a module with one hook::

       from kvxfer.plugin import hookimpl

       @hookimpl
       def kvxfer_register_backends(register):
           register("mybackend", "kvxfer_mybackend.backend:MyBackend",
                    requires=("mytransport",), install="pip install kvxfer-mybackend",
                    summary="one line for `kvxfer backends`")

3. Name that module in your distribution's ``kvxfer`` entry-point group::

       [project.entry-points.kvxfer]
       mybackend = "kvxfer_mybackend"

4. Prove it with the conformance suite: subclass
   :class:`kvxfer.testing.BackendConformance` in your tests.

A backend's product code imports only ``kvxfer`` (the user's names: ``Allocation``,
``DescriptorList``, ``MemoryKind``, ``Op`` and the typed errors) and this package, which
re-exports the core's pieces a backend may lean on: :class:`Deadline`, ``check_timeout`` and
``current_deadline`` (time, :mod:`kvxfer.deadlines`), :class:`SpanIndex` and ``merge_runs``,
:class:`Pump`, ``install_hint``, :class:`Live`, and the submodules below
(``tests/test_plugin_face.py`` holds every in-tree plugin to it); its tests may also use
:mod:`kvxfer.testing`.

The factory string is imported only when an agent first uses the backend, so listing
backends never loads a transport library, and a missing dependency is reported with the
``install`` command. Shared building blocks for data paths live in the core:
:class:`SpanIndex` (containment checks), ``merge_runs`` and :class:`Pump`
(notification delivery when nobody polls). A backend with more than one way of moving bytes
keeps them as :class:`DataPath` rows (:mod:`kvxfer.plugin.datapath`) and subclasses
:class:`PathBackend`, which holds the post loop over them (choose, start, poll, notify after
the data, pump, cancel); the core's same-host GPU path, :class:`kvxfer.cuda.DevicePath`, is such a row.
A backend reads its peers' blobs with the core's wire toolkit, :mod:`kvxfer.plugin.wire`
(a bounded reader, strict JSON, one rule for text and one for integers).
A backend that proves who sent a same-host blob uses :mod:`kvxfer.plugin.identity` (the
sender's identity in the blob, its proof page, and :func:`~kvxfer.plugin.identity.prove`).
A backend whose peer may live in this very process finds it in :class:`Live`
(:mod:`kvxfer.plugin.live`), which resolves an instance id only with this process's token.
A backend that proves a peer's bytes on native code first uses :mod:`kvxfer.plugin.prover`;
one built on UCX reads UCX's internals through :mod:`kvxfer.plugin.ucxabi`.
A backend that can also serve the store's file I/O returns a :class:`FilePath`
(:mod:`kvxfer.plugin.files`) from ``Backend.file_path()``.
"""

from __future__ import annotations

from ..deadlines import Deadline, check_timeout, current_deadline
from ..extras import install_hint
from ..progress import Pump
from ..spans import SpanIndex, merge_runs
from .backend import Backend, Capabilities, Option
from .datapath import DataPath, choose
from .files import FilePath
from .hookspecs import RegisterBackend, hookimpl, hookspec
from .live import Live
from .pathbackend import PathBackend, Post

__all__ = ["Backend", "Capabilities", "DataPath", "Deadline", "FilePath", "Live", "Option", "PathBackend", "Post",
           "Pump", "RegisterBackend", "SpanIndex", "check_timeout", "choose", "current_deadline", "hookimpl", "hookspec",
           "install_hint", "merge_runs"]
