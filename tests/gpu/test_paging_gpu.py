"""jaxrope.paging against FlashInfer itself (its page helpers run on CUDA tensors).

``flashinfer.get_seq_lens`` and ``get_batch_indices_positions`` against
:func:`jaxrope.paging.append_positions` on the ragged batches of the parity tests; the
slots those positions give are already checked against ``append_paged_kv_cache``'s
writes by ``tests/gpu/test_kv_append_gpu.py`` (``PagedBatch.slots`` is
:func:`jaxrope.paging.page_table_slots`).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxrope import paging
from jaxrope.testing import flashinfer_kv

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("page_size", [1, 16])
def test_append_positions_are_flashinfers(page_size, flashinfer, device, rng):
    import torch
    batch = flashinfer_kv.paged_batch(rng, flashinfer_kv.APPEND, flashinfer_kv.CACHED,
                                      pages=4096, page_size=page_size)
    append = np.asarray(flashinfer_kv.APPEND, np.int32)
    ids = flashinfer_kv.batch_tensors(batch, device)
    append_indptr = torch.tensor(np.concatenate([[0], np.cumsum(append)]), dtype=torch.int32,
                                 device=device)
    seq_lens = flashinfer.get_seq_lens(ids["kv_indptr"], ids["kv_last_page_len"], page_size)
    fi_b, fi_p = flashinfer.get_batch_indices_positions(append_indptr, seq_lens, int(append.sum()))
    b, p = paging.append_positions(append, batch.kv_indptr, batch.kv_last_page_len,
                                   page_size=page_size, num_tokens=int(append.sum()))
    np.testing.assert_array_equal(np.asarray(b), fi_b.cpu().numpy())
    np.testing.assert_array_equal(np.asarray(p), fi_p.cpu().numpy())
