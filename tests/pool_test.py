"""The multi-sequence pool (rkv.pool, issue 14): bookkeeping, attention, sharing, save/load.

Attention through a pool is held to the float64 NumPy reference over each sequence's own cells
(tests/numpy_reference.py), every step of ragged, joining, shared and rewound sequences, with
pages moving to the host under a small device part, for every tactic a pool serves. The model-level
gates (each sequence's logits equal its own run) are in tests/serving_vs_resident_test.py.
Glossary: B T H K D (rkv/__init__.py); R device rows, P page cells.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import pool as pool_lib
from rkv.models import kv as kv_lib
from rkv.offload import memory
from tests import numpy_reference
from tests.support.tolerances import TOLERANCES

H, K, D, V = 4, 2, 16, 100
O_TOL = TOLERANCES["float32"]["o"]


@dataclasses.dataclass(frozen=True)
class _Config:  # the fields of a ModelConfig a pool reads
  num_layers: int = 2
  num_kv_heads: int = K
  head_dim: int = D
  dtype: str = "float32"
  vocab_size: int = V


class _Driver:
  """Steps a pool with random q/k/v and checks every fed query against the NumPy reference over
  the cells its sequence holds (its history, kept here)."""

  def __init__(self, pool, seed=0):
    self.pool, self.rng = pool, np.random.default_rng(seed)
    self.hist: dict[int, list] = {}  # seq -> per layer [k (S,K,D), v (S,K,D)]

  def add(self, share_from=None, length=0):
    sid = self.pool.add(share_from, length)
    L = self.pool.config.num_layers
    self.hist[sid] = ([[h[0][:length], h[1][:length]] for h in self.hist[share_from]]
                      if share_from is not None else
                      [[np.zeros((0, K, D), np.float32)] * 2 for _ in range(L)])
    return sid

  def rewind(self, sid, position):
    self.pool.rewind(sid, position)
    self.hist[sid] = [[h[0][:position], h[1][:position]] for h in self.hist[sid]]

  def step(self, feeds, impl="xla"):
    feeds = [(sid, self.rng.integers(1, V, n).tolist()) for sid, n in feeds]
    tokens, q_pos, caches = self.pool.prepare(feeds)
    b, t = tokens.shape
    new = []
    for layer, cache in enumerate(caches):
      assert isinstance(cache, kv_lib.LayerCache) and not cache.jittable
      q = self.rng.standard_normal((b, t, H, D)).astype(np.float32)
      k = self.rng.standard_normal((b, t, K, D)).astype(np.float32)
      v = self.rng.standard_normal((b, t, K, D)).astype(np.float32)
      o, c = cache.attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(q_pos),
                          window=None, softcap=None, scale=None, impl=impl)
      new.append(c)
      o = np.asarray(o)
      for row, (sid, toks) in enumerate(feeds):
        n = len(toks)
        h = self.hist[sid][layer]
        h[0] = np.concatenate([h[0], k[row, t - n:]])
        h[1] = np.concatenate([h[1], v[row, t - n:]])
        s = h[0].shape[0]
        o_ref, _ = numpy_reference.attention(
            q[row:row + 1, t - n:], h[0][None], h[1][None], q_pos=q_pos[row:row + 1, t - n:],
            k_pos=np.arange(s, dtype=np.int32)[None])
        np.testing.assert_allclose(o[row, t - n:], o_ref[0], atol=O_TOL[0], rtol=O_TOL[1],
                                   err_msg=f"layer {layer}, sequence {sid}, {s} cells")
      # padding rows and padding queries see nothing
      for row in range(len(feeds), b):
        assert np.all(o[row] == 0)
    self.pool.commit(new)
    for sid, toks in feeds:
      assert self.pool.length(sid) == self.hist[sid][0][0].shape[0]


# ----------------------------------------------------------------------------------------------
# The planner's windows
# ----------------------------------------------------------------------------------------------
def test_pool_windows_resident_when_everything_fits_else_water_filled():
  assert rkv.planner.pool_windows([10, 20], 64, 8) == (10, 20)
  w = rkv.planner.pool_windows([100, 10, 300], 120, 8, feeds=[1, 1, 1])
  assert w[1] == 10 and w[0] == w[2] and w[0] < 100  # the short one resident, the others share
  assert rkv.planner.pool_occupancy([100, 10, 300], [1, 1, 1], w[0], 8) <= 120
  assert rkv.planner.pool_occupancy([100, 10, 300], [1, 1, 1], w[0] + 1, 8) > 120
  with pytest.raises(ValueError, match="cannot hold 3 sequences between page moves"):
    rkv.planner.pool_windows([100, 100, 100], 20, 8, feeds=[1, 1, 1])
  with pytest.raises(ValueError, match="feeds must have one entry"):
    rkv.planner.pool_windows([1, 2], 20, 8, feeds=[1])


# ----------------------------------------------------------------------------------------------
# Attention: ragged, continuous, every tactic
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tactic", ["stream", "cpu", "hybrid", "resident"])
def test_ragged_continuous_batch_equals_the_reference_per_sequence(tactic):
  rows, pages = (128, 0) if tactic == "resident" else (40, 24)
  pool = pool_lib.Pool(_Config(), device_rows=rows, host_pages=pages, page_cells=4,
                       tactic=tactic, row_bucket=40)
  dr = _Driver(pool)
  a, b = dr.add(), dr.add()
  dr.step([(a, 8), (b, 5)])            # ragged prefill chunks
  c = dr.add()                         # joins between steps
  dr.step([(a, 8), (c, 8), (b, 1)])    # prefill beside decode
  dr.step([(a, 8), (c, 5), (b, 1)])
  dr.step([(a, 6), (c, 1), (b, 1)])
  pool.release(b)                      # leaves
  for _ in range(3):
    dr.step([(a, 1), (c, 1)])          # decode (the cpu/hybrid kernel path)
  if tactic == "resident":
    assert pool.free_pages == 0 and all(not pool.table(s)["pages"] for s in (a, c))
  else:
    assert pool.table(a)["pages"], "a long sequence keeps its oldest cells in host pages"
    kinds = {memory.memory_kind(x) for x in pool.caches[0].host_k if x is not None}
    assert kinds == {"pinned_host"}
  assert pool.length(a) == 33 and pool.length(c) == 17


def test_the_pool_serves_no_head_tactic_and_checks_its_input():
  with pytest.raises(ValueError, match="'head' splits the KV heads .* no pool form"):
    pool_lib.Pool(_Config(), device_rows=8, host_pages=2, page_cells=4, tactic="head")
  with pytest.raises(ValueError, match="'resident' keeps every cell on the device"):
    pool_lib.Pool(_Config(), device_rows=8, host_pages=2, page_cells=4, tactic="resident")
  with pytest.raises(ValueError, match="int8 pools are not implemented"):
    pool_lib.Pool(_Config(), device_rows=8, page_cells=4, dtype="int8")
  with pytest.raises(ValueError, match="cpu_fraction is only valid"):
    pool_lib.Pool(_Config(), device_rows=8, page_cells=4, cpu_fraction=0.5)
  pool = pool_lib.Pool(_Config(), device_rows=8, host_pages=0, page_cells=4)
  a = pool.add()
  with pytest.raises(ValueError, match="no sequence 7"):
    pool.prepare([(7, [1])])
  with pytest.raises(ValueError, match="fed twice"):
    pool.prepare([(a, [1]), (a, [2])])
  with pytest.raises(ValueError, match="no step layout"):
    pool.caches[0].attend(jnp.zeros((1, 1, H, D)), jnp.zeros((1, 1, K, D)),
                          jnp.zeros((1, 1, K, D)), jnp.zeros((1, 1), jnp.int32))
  with pytest.raises(ValueError, match="no free host page"):
    pool.prepare([(a, [1] * 8)])
    pool.commit(pool.caches)
    pool.prepare([(a, [1])])
  pool.abort()


# ----------------------------------------------------------------------------------------------
# Sharing, rewind, conversation
# ----------------------------------------------------------------------------------------------
def test_prefix_sharing_refcounts_partial_pages_and_rewind():
  pool = pool_lib.Pool(_Config(), device_rows=24, host_pages=16, page_cells=4, row_bucket=24)
  dr = _Driver(pool, seed=1)
  a = dr.add()
  dr.step([(a, 8)])
  dr.step([(a, 8)])
  pool.maintain(windows={a: 0})        # a kept turn: its whole pages move to the host
  ta = pool.table(a)
  assert len(ta["pages"]) == 4 and ta["rows"] == []
  b = dr.add(share_from=a, length=10)  # shares pages 0-1 whole and page 2 for 2 of its 4 cells
  tb = pool.table(b)
  assert tb["pages"] == [ta["pages"][0], ta["pages"][1], (ta["pages"][2][0], 2)]
  assert [pool.refcount(page=p) for p, _ in ta["pages"]] == [2, 2, 2, 1]
  dr.step([(a, 1), (b, 3)])            # b reads the shared page masked past its 2 cells
  src, n = pool.find_prefix(pool.tokens(b) + [5])
  assert (src, n) == (b, 13)
  c = dr.add(share_from=b, length=12)  # shares b's device rows (rows: page size 1)
  shared_row = pool.table(b)["rows"][0]
  assert pool.refcount(row=shared_row) == 2
  dr.step([(c, 2), (b, 1), (a, 1)])
  dr.rewind(b, 9)                      # back into the shared host page
  assert pool.table(b)["pages"][-1][1] == 1 and pool.table(b)["rows"] == []
  assert pool.refcount(row=shared_row) == 1  # c still holds it
  dr.step([(b, 2), (c, 1)])
  free = pool.free_rows, pool.free_pages
  for s in (a, b, c):
    pool.release(s)
  assert pool.free_rows == 24 and pool.free_pages == 16 and free != (24, 16)
  assert not pool.seqs


def test_sharers_moving_the_same_rows_write_one_page():
  pool = pool_lib.Pool(_Config(), device_rows=32, host_pages=8, page_cells=4, row_bucket=32)
  dr = _Driver(pool, seed=2)
  a = dr.add()
  dr.step([(a, 6)])
  b = dr.add(share_from=a, length=6)
  assert pool.maintain(windows={a: 0, b: 0}) == 1  # one page for both
  assert pool.table(a)["pages"] == pool.table(b)["pages"]
  assert pool.refcount(page=pool.table(a)["pages"][0][0]) == 2
  dr.step([(a, 1), (b, 2)])


# ----------------------------------------------------------------------------------------------
# Save / load a session
# ----------------------------------------------------------------------------------------------
def _session():
  pool = pool_lib.Pool(_Config(), device_rows=40, host_pages=24, page_cells=4, row_bucket=40)
  dr = _Driver(pool, seed=3)
  a = dr.add()
  dr.step([(a, 8)])
  dr.step([(a, 8)])
  b = dr.add(share_from=a, length=11)
  dr.step([(a, 2), (b, 3)])
  return pool, dr, a, b


def test_save_and_resume_under_another_device_budget(tmp_path):
  pool, dr, a, b = _session()
  pool.save(str(tmp_path / "s"))
  for rows in (40, 18):                # the same split, and a smaller device part
    loaded = pool_lib.Pool.load(str(tmp_path / "s"), _Config(), device_rows=rows, host_pages=24,
                                row_bucket=rows)
    assert {s: loaded.tokens(s) for s in loaded.seqs} == {s: pool.tokens(s) for s in pool.seqs}
    ta, tb = loaded.table(a), loaded.table(b)
    if rows == 18:
      assert len(ta["rows"]) < len(pool.table(a)["rows"])  # more of it on the host now
    # the shared prefix is still shared
    shared = {p for p, _ in ta["pages"]} & {p for p, _ in tb["pages"]}
    assert shared or set(ta["rows"]) & set(tb["rows"])
    d2 = _Driver(loaded, seed=4)
    d2.hist = {s: [[h[0].copy(), h[1].copy()] for h in hs] for s, hs in dr.hist.items()}
    d2.step([(a, 1), (b, 1)])
    d2.step([(b, 3)])


def _fail_fsync(monkeypatch):
  def full(fd):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(pool_lib.os, "fsync", full)


def _fail_pages_file(monkeypatch):
  real = open
  def failing(path, *a, **kw):
    if str(path).endswith("pages.bin"):
      raise OSError(5, "Input/output error")
    return real(path, *a, **kw)
  monkeypatch.setattr("builtins.open", failing)


@pytest.mark.parametrize("fault,why", [(_fail_fsync, "No space left"),
                                       (_fail_pages_file, "Input/output error")],
                         ids=["disk_full", "write_fails_midway"])
def test_a_failed_save_keeps_the_previous_one(tmp_path, monkeypatch, fault, why):
  pool, dr, a, b = _session()
  directory = tmp_path / "s"
  pool.save(str(directory))
  before = {s: pool.tokens(s) for s in pool.seqs}
  dr.step([(a, 1)])                    # the session moves on
  fault(monkeypatch)
  with pytest.raises(ValueError, match=f"could not save.*{why}.*previous save there.*unchanged"):
    pool.save(str(directory))
  monkeypatch.undo()
  assert [x for x in os.listdir(tmp_path) if x.startswith(".s.")] == []
  loaded = pool_lib.Pool.load(str(directory), _Config(), device_rows=40, host_pages=24)
  assert {s: loaded.tokens(s) for s in loaded.seqs} == before
  (directory / "rows.bin").write_bytes(b"x" * os.path.getsize(directory / "rows.bin"))
  with pytest.raises(ValueError, match="fails its CRC-32"):
    pool_lib.Pool.load(str(directory), _Config(), device_rows=40, host_pages=24)


_KILLED_WRITER = """
import os, signal, sys
import numpy as np
from rkv import pool as pool_lib
from tests.pool_test import _Config
pool = pool_lib.Pool(_Config(), device_rows=16, host_pages=4, page_cells=4)
s = pool.add()
pool.extend(s, [1] * 6, [(np.ones((6, 2, 16), np.float32),) * 2] * 2)
real = open
def dying(path, *a, **kw):
  if str(path).endswith("pages.bin"):  # rows.bin is written: the writer dies midway
    os.kill(os.getpid(), signal.SIGKILL)
  return real(path, *a, **kw)
import builtins
builtins.open = dying
pool.save(sys.argv[1])
"""


def test_a_killed_writer_keeps_the_previous_save(tmp_path):
  import subprocess
  import sys
  pool, _, a, b = _session()
  directory = tmp_path / "s"
  pool.save(str(directory))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(directory)], cwd=root,
                        capture_output=True, timeout=300,
                        env=dict(os.environ, PYTHONPATH=root))
  assert proc.returncode == -9, proc.stderr.decode()[-2000:]
  loaded = pool_lib.Pool.load(str(directory), _Config(), device_rows=40, host_pages=24)
  assert {s: loaded.tokens(s) for s in loaded.seqs} == {s: pool.tokens(s) for s in pool.seqs}


def test_save_refuses_a_directory_holding_other_files(tmp_path):
  (tmp_path / "notes.txt").write_text("mine")
  pool = pool_lib.Pool(_Config(), device_rows=8, page_cells=4)
  with pytest.raises(ValueError, match=r"holds \['notes.txt'\] besides a pool save"):
    pool.save(str(tmp_path))


# ----------------------------------------------------------------------------------------------
# At the Llama-3-8B attention shape on a GPU (Pallas kernels, bf16, pages streamed for real)
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("tactic", ["stream", "hybrid"])
def test_a_ragged_bf16_pool_at_the_llama_shape_equals_the_reference(tactic):
  import jax
  h, kh, d = 32, 8, 128
  cfg = dataclasses.replace(_Config(num_layers=1), num_kv_heads=kh, head_dim=d, dtype="bfloat16")
  pool = pool_lib.Pool(cfg, device_rows=40960, host_pages=16, page_cells=4096, tactic=tactic)
  rng = np.random.default_rng(5)
  lengths = (20000, 9000, 33000)
  needs = {i: n + 600 for i, n in enumerate(lengths)}
  hist = {}
  for n in lengths:
    s = pool.add()
    k = rng.standard_normal((n, kh, d)).astype(jnp.bfloat16)
    v = rng.standard_normal((n, kh, d)).astype(jnp.bfloat16)
    for lo in range(0, n, 4096):
      pool.extend(s, [1] * min(4096, n - lo), [(k[lo:lo + 4096], v[lo:lo + 4096])], needs=needs)
    hist[s] = [k, v]
  assert all(pool.table(s)["pages"] for s in (0, 2))
  tol = TOLERANCES["bfloat16"]["o"]
  for t in (512, 1):                   # a prefill chunk, then a decode step
    feeds = [(s, [1] * t) for s in hist]
    tokens, q_pos, caches = pool.prepare(feeds, needs=needs)
    b, tt = tokens.shape
    q = jnp.asarray(rng.standard_normal((b, tt, h, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, tt, kh, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, tt, kh, d)), jnp.bfloat16)
    o, c = caches[0].attend(q, k, v, jnp.asarray(q_pos), impl="pallas")
    pool.commit([c])
    for row, (s, _) in enumerate(feeds):
      hist[s] = [np.concatenate([hist[s][0], np.asarray(k[row, tt - t:])]),
                 np.concatenate([hist[s][1], np.asarray(v[row, tt - t:])])]
      o_ref, _ = rkv.attention(q[row:row + 1, tt - t:], jnp.asarray(hist[s][0])[None],
                               jnp.asarray(hist[s][1])[None],
                               q_pos=jnp.asarray(q_pos[row:row + 1, tt - t:]), impl="reference")
      np.testing.assert_allclose(np.asarray(o[row, tt - t:], np.float32),
                                 np.asarray(o_ref[0], np.float32), atol=tol[0], rtol=tol[1])
    jax.block_until_ready(o)
