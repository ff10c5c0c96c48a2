"""The loopback backend passes the conformance suite (and, with a GPU, on CUDA tensors)."""

from kvxfer.testing import BackendConformance


class TestLoopback(BackendConformance):
    backend = "loopback"


class TestLoopbackVRAM(BackendConformance):
    backend = "loopback"
    memory = "VRAM"  # skipped without CUDA


class TestLoopbackOwner(BackendConformance):
    backend = "loopback"
    owned = True  # every case through kvxfer.Owner
