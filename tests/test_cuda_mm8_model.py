"""The tensor-core mm8 kernel's arithmetic on CPU (kvxfer/cuda/mm8_model.py).

``kvxfer_mm8_tc`` is emulated lane by lane from the very table and B words the host hands
it; its sums, mixed with the lengths as the host does, must equal kvxfer.integrity's mm8 of
the same bytes (random data, odd lengths, cells cut into pieces). tests/test_cuda_digest_gpu.py
runs the kernel itself on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.cuda import mm8_model as model
from kvxfer.cuda.digest import mm8_table
from kvxfer.integrity.digests import _mm8_rows
from kvxfer.integrity.mm8 import finalize

LENGTHS = [1, 15, 1000, 1024, 1025, 17000, 40961]


def _digests(piece: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(piece)
    mem = rng.integers(0, 256, sum(LENGTHS) + 16 * len(LENGTHS), dtype=np.uint8)
    starts = np.concatenate([[0], np.cumsum(np.array(LENGTHS) + 16)[:-1]])
    starts = (starts + 15) // 16 * 16  # the kernel's cells start on 16-byte boundaries
    mem = np.concatenate([mem, np.zeros(16 * len(LENGTHS), np.uint8)])
    base = mem.ctypes.data
    table = mm8_table((starts + base).astype(np.uint64), np.array(LENGTHS, np.uint64), piece=piece)
    sums = model.emulate(table, len(LENGTHS), lambda a, k: mem[a - base:a - base + k])
    got = np.concatenate([finalize(sums[i:i + 1].view(np.int64), n) for i, n in enumerate(LENGTHS)]).view(np.uint64)
    want = np.array([int(_mm8_rows(mem[None, s:s + n])[0]) for s, n in zip(starts, LENGTHS)]).view(np.uint64)
    return got, want


@pytest.mark.parametrize("piece", [8192, 65536])
def test_tensor_core_kernel_model_equals_the_integrity_definition(piece: int) -> None:
    got, want = _digests(piece)
    np.testing.assert_array_equal(got, want)


def test_control_a_misplaced_b_word_gives_other_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    good = model.pack_b()
    monkeypatch.setattr(model, "pack_b", lambda: good[:, :, [0, 2, 1, 3]].copy())  # y and z fed swapped
    got, want = _digests(65536)
    assert (got != want)[np.array(LENGTHS) > 16].all()


def test_b_words_pack_every_sketch_entry_once() -> None:
    b = model.pack_b()
    assert b.shape == (16, 32, 4) and b.dtype == np.uint32
    from kvxfer.integrity.mm8 import sketch_matrix

    K = sketch_matrix().view(np.uint8)
    seen = np.sort(b.view(np.uint8).ravel())
    np.testing.assert_array_equal(seen, np.sort(K.ravel()))
