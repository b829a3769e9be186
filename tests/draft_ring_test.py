"""The drafter's ring over a host copy, its rollback from the host, and the resident fallback
when the host copy cannot be had (rkv/sparse/ring.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from rkv import sparse
from tests import numpy_reference as ref
from tests.support.tolerances import TOLERANCES

B, K, G, D, R, W, CAP = 2, 2, 2, 8, 6, 6, 40
TOL = TOLERANCES["float32"]


def _cells(rng, t):
  return (rng.standard_normal((B, t, K, D)).astype(np.float32),
          rng.standard_normal((B, t, K, D)).astype(np.float32))


def _check(kv, ks, vs, n, rng):
  q = rng.standard_normal((B, 1, K * G, D)).astype(np.float32)
  qp = np.full((B, 1), n - 1, np.int32)  # the reader's query at the newest cell
  o, lse = kv.attend(jnp.asarray(q), jnp.asarray(qp), window=W, impl="xla")
  o_ref, lse_ref = ref.attention(q, ks[:, :n], vs[:, :n], qp, np.broadcast_to(np.arange(n), (B, n)),
                                 window=W)
  np.testing.assert_allclose(np.asarray(o), o_ref, rtol=TOL["o"][1], atol=TOL["o"][0])
  np.testing.assert_allclose(np.asarray(lse), lse_ref, rtol=TOL["lse"][1], atol=TOL["lse"][0])


@pytest.mark.parametrize("fallback", [False, True])
def test_ring_reads_the_window_and_rolls_back_from_the_host(fallback):
  rng = np.random.default_rng(0)
  memory = (1 << 40, 1 << 10) if fallback else (1 << 40, 1 << 40)
  if fallback:
    with pytest.warns(sparse.DraftFallbackWarning, match="available"):
      kv = sparse.draft_kv(B, CAP, K, D, ring_cells=R, dtype=jnp.float32, memory=memory)
    assert isinstance(kv, sparse.ResidentDraftKV) and "available" in kv.reason
  else:
    kv = sparse.draft_kv(B, CAP, K, D, ring_cells=R, dtype=jnp.float32, memory=memory)
    assert isinstance(kv, sparse.DraftRing) and kv.backing == "host"
  ks, vs = _cells(rng, 30)
  n = 0
  for t in (9, 1, 1, 5, 1):  # a chunk longer than the ring, then steps that wrap it
    kv = kv.append(ks[:, n:n + t], vs[:, n:n + t], np.broadcast_to(np.arange(n, n + t), (B, t)))
    n += t
    _check(kv, ks, vs, n, rng)
  # A rejected draft: back to 12 cells, then other cells from there; the ring is rebuilt from
  # the host copy and reads exactly as if the rejected cells had never been written.
  kv = kv.truncate(12)
  assert kv.length == 12
  _check(kv, ks, vs, 12, rng)
  ks2, vs2 = _cells(rng, 3)
  ks[:, 12:15], vs[:, 12:15] = ks2, vs2
  kv = kv.append(ks2, vs2, np.broadcast_to(np.arange(12, 15), (B, 3)))
  _check(kv, ks, vs, 15, rng)
  if not fallback:
    np.testing.assert_array_equal(kv.host_k[:, :15], ks[:, :15])  # write-through to the host


def test_fallback_on_the_pinned_pool_and_errors(monkeypatch):
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "0.000001")
  with pytest.warns(sparse.DraftFallbackWarning, match="pinned-host pool"):
    kv = sparse.draft_kv(B, CAP, K, D, ring_cells=R, dtype=jnp.float32,
                         memory=(1 << 40, 1 << 40))
  assert kv.backing == "resident"
  with pytest.raises(ValueError, match="ring_cells"):
    sparse.DraftRing.empty(B, CAP, K, D, ring_cells=CAP + 1)
  ring = sparse.DraftRing.empty(B, CAP, K, D, ring_cells=R, dtype=jnp.float32)
  with pytest.raises(ValueError, match="window"):
    ring.attend(jnp.zeros((B, 1, K * G, D)), jnp.zeros((B, 1), jnp.int32), window=R + 1)
  with pytest.raises(ValueError, match="truncate"):
    ring.truncate(1)
