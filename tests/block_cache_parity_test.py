"""The block cache's parity test (in the spirit of Strata's ``kv_stream_parity``): attention
through the block cache equals attention over the same selected blocks read from a resident
copy, bitwise (same kernel, same block order), for bf16 and int8, across evictions, appends that
write through to resident slots, and a save/load; the residency map is consistent after every
step and the counters add up."""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

from rkv import sparse
from rkv.models.kv import LayerCache
from tests import numpy_reference as ref
from tests.support.tolerances import TOLERANCES

B, KH, G, D = 2, 2, 2, 16
CFG = sparse.BlockCacheConfig(block_cells=8, device_slots=12, select_blocks=4, window_blocks=1,
                              sink_blocks=1)


def _resident_attention(cache, q, positions, ids):
  """The same blocks, in the same order, read from a resident copy of every block."""
  k, v, pos, ks, vs = cache.resident_copy()
  ids = np.asarray(ids)
  slots = np.where(ids < 0, -1, np.arange(cache.batch)[:, None, None] * cache.n_blocks + ids)
  return sparse.block_attention(q, k, v, jnp.asarray(slots, jnp.int32),
                                block_cells=cache.block_cells, pos=pos, q_pos=positions,
                                k_scale=ks, v_scale=vs, impl="xla")


def _check_slots(cache):
  """Every resident slot holds its block's host bytes (never stale); the map is consistent."""
  sparse.check_residency(cache.residency)
  bs, nb = cache.block_cells, cache.n_blocks
  ks, vs, ps = np.asarray(cache.k_slots), np.asarray(cache.v_slots), np.asarray(cache.slot_pos)
  for s, flat in enumerate(cache.residency.slot_block):
    if flat < 0:
      continue
    b, n = divmod(int(flat), nb)
    rows = slice(s * bs, (s + 1) * bs)
    np.testing.assert_array_equal(ks[rows], cache.store.kv[b, n, 0])
    np.testing.assert_array_equal(vs[rows], cache.store.kv[b, n, 1])
    np.testing.assert_array_equal(ps[rows], cache.store.pos[b, n])
    if cache.quantized:
      np.testing.assert_array_equal(np.asarray(cache.k_scale_slots)[rows], cache.store.scale[b, n, 0])


def _run(cache, rng, steps, *, start, steps_log, forced=None):
  outs = []
  for i in range(steps):
    p = start + i
    k = jnp.asarray(rng.standard_normal((B, 1, KH, D)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((B, 1, KH, D)).astype(np.float32))
    q = jnp.asarray(rng.standard_normal((B, 1, KH * G, D)).astype(np.float32))
    positions = jnp.full((B, 1), p, jnp.int32)
    before = cache.totals
    cache = cache.append(k, v, positions)
    _check_slots(cache)  # the append wrote through to the resident slot of the open block
    blocks = None
    if forced is not None:  # a selection that sweeps the blocks: forces evictions
      nbk = cache.filled_blocks
      pick = lambda: np.sort(np.r_[0, nbk - 1, 1 + rng.permutation(nbk - 2)[:2]])
      blocks = np.stack([np.stack([pick() for _ in range(KH)]) for _ in range(B)]).astype(np.int32)
    o, lse, ids, cache = cache.step(q, positions, blocks=blocks, impl="xla")
    o_ref, lse_ref = _resident_attention(cache, q, positions, ids)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_ref))
    _check_slots(cache)
    # Counters: the step's needed blocks split into hits and misses; totals are the sum of steps;
    # bytes are the missed blocks' bytes.
    ids_np = np.asarray(ids)
    need = len(np.unique((np.arange(B)[:, None, None] * cache.n_blocks + ids_np)[ids_np >= 0]))
    st = cache.last_step
    assert st.hits + st.misses == need
    assert st.bytes_from_host == st.misses * cache.store.block_bytes
    assert st.moved_bytes == (st.misses and 1 << (st.misses - 1).bit_length()) * cache.store.block_bytes
    assert st.transfers == int(st.misses > 0)  # one batched transfer per step, not per block
    assert cache.totals == before + st
    steps_log.append(st)
    outs.append((np.asarray(o), np.asarray(lse)))
  return cache, outs


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_block_cache_parity(dtype, tmp_path):
  rng = np.random.default_rng(0)
  s0 = 61  # not a multiple of the block: the open block fills during the run
  k = rng.standard_normal((B, s0, KH, D)).astype(np.float32)
  v = rng.standard_normal((B, s0, KH, D)).astype(np.float32)
  cache = sparse.BlockCache.from_arrays(jnp.asarray(k), jnp.asarray(v), config=CFG,
                                        capacity=128, dtype=dtype)
  assert isinstance(cache, LayerCache)
  log = []
  cache, _ = _run(cache, rng, 6, start=s0, steps_log=log)          # Quest selection
  cache, _ = _run(cache, rng, 6, start=s0 + 6, steps_log=log, forced=True)  # sweeps: evictions
  assert sum(s.evictions for s in log) > 0
  assert sum(s.hits for s in log) > 0
  assert cache.totals.steps == len(log)
  assert cache.totals.bytes_from_host == sum(s.bytes_from_host for s in log)
  # Save, load (cold: nothing resident), and continue both with the same inputs: bitwise equal.
  sparse.save(cache, str(tmp_path / "c"))
  loaded = sparse.load(str(tmp_path / "c"))
  assert loaded.fill == cache.fill and loaded.residency.slot_block.max() == -1
  np.testing.assert_array_equal(np.asarray(loaded.k_min), np.asarray(cache.k_min))
  state = rng.bit_generator.state
  cache, out_a = _run(cache, rng, 4, start=s0 + 12, steps_log=[], forced=True)
  rng.bit_generator.state = state
  loaded, out_b = _run(loaded, rng, 4, start=s0 + 12,
                       steps_log=[], forced=True)
  for (oa, la), (ob, lb) in zip(out_a, out_b):
    np.testing.assert_array_equal(oa, ob)
    np.testing.assert_array_equal(la, lb)


def test_clock_gives_a_second_chance():
  cfg = sparse.BlockCacheConfig(block_cells=4, device_slots=3, select_blocks=2, window_blocks=1,
                                sink_blocks=0)
  cache = sparse.BlockCache.from_arrays(jnp.ones((1, 24, 1, 4)), jnp.ones((1, 24, 1, 4)),
                                        config=cfg)
  def need(c, blocks):
    return c.make_resident(np.array([[blocks]], np.int32))
  c = need(cache, [0, 1])
  c = need(c, [2, 5])                     # slot 2 free for 2, 5 evicts by CLOCK
  sparse.check_residency(c.residency)
  # All bits were set: the hand cleared slots 0 (block 0) and 1 (block 1), then 2 (block 2) is
  # needed this step and skipped; back at slot 0, its bit is clear: block 0 goes.
  assert c.residency.page_table[0, 0] == -1 and c.residency.page_table[0, 5] == 0
  assert c.last_step.evictions == 1 and c.last_step.misses == 2
  c = need(c, [1, 5])                     # hits set 1's bit again
  assert c.last_step.hits == 2 and c.last_step.misses == 0
  # Every bit is set again (slot 2 was filled with its bit set). Miss 3: the hand (at slot 1)
  # clears slots 1 and 2, skips slot 0 (block 5, needed), and takes slot 1: block 1 goes.
  c = need(c, [3, 5])
  sparse.check_residency(c.residency)
  np.testing.assert_array_equal(c.residency.slot_block, [5, 3, 2])
  assert not c.residency.ref[2] and c.residency.hand == 2
  # Block 2 was not used since its bit was cleared: the next miss takes slot 2 at once.
  c = need(c, [4, 5])
  np.testing.assert_array_equal(c.residency.slot_block, [5, 3, 4])
  assert c.last_step.evictions == 1 and c.totals.evictions == 3
  assert c.totals.misses == 2 + 2 + 0 + 1 + 1 and c.totals.hits == 0 + 0 + 2 + 1 + 1
  with pytest.raises(ValueError, match="device_slots"):
    cache.make_resident(np.array([[[0, 1], [2, 3]]], np.int32).reshape(1, 1, 4))


def _clock_one_slot(res, needed):
  """CLOCK as a loop over the slots, one missed block at a time (the rule clock_slots batches)."""
  free = np.flatnonzero(res.slot_block < 0)
  if len(free):
    return int(free[0]), -1
  n = len(res.slot_block)
  for _ in range(2 * n + 1):
    s = res.hand
    res.hand = (res.hand + 1) % n
    if needed[s]:
      continue
    if res.ref[s]:
      res.ref[s] = False
      continue
    return s, int(res.slot_block[s])
  raise AssertionError("no victim")


def test_clock_slots_equals_the_one_slot_loop():
  rng = np.random.default_rng(3)
  for trial in range(400):
    n = int(rng.integers(1, 40))
    slot_block = np.where(rng.random(n) < rng.choice([0.0, 0.2, 0.6]), -1,
                          rng.permutation(1000)[:n]).astype(np.int32)
    res = sparse.block_cache.Residency(np.zeros((1, 1), np.int32), slot_block,
                                       rng.random(n) < rng.random(), int(rng.integers(n)))
    needed = rng.random(n) < rng.choice([0.0, 0.3, 0.8])
    m = int(rng.integers(0, n - needed.sum() + 1))
    want_res, want_needed, want = res.copy(), needed.copy(), []
    for i in range(m):
      s, evicted = _clock_one_slot(want_res, want_needed)
      want_res.slot_block[s] = 2000 + i  # taken: no longer free
      want_res.ref[s] = True
      want_needed[s] = True
      want.append((s, evicted))
    got_slots, got_evicted = sparse.block_cache.clock_slots(res, needed, m)
    res.ref[got_slots] = True
    assert list(zip(got_slots.tolist(), got_evicted.tolist())) == want, trial
    np.testing.assert_array_equal(res.ref, want_res.ref)
    np.testing.assert_array_equal(needed, want_needed)
    assert res.hand == want_res.hand, trial


def test_attend_prefill_is_dense_and_decode_reads_the_selection():
  rng = np.random.default_rng(1)
  cfg = sparse.BlockCacheConfig(block_cells=8, device_slots=16, select_blocks=16, window_blocks=1)
  cache = sparse.BlockCache.empty(1, 64, KH, D, config=cfg, dtype=jnp.float32)
  k = rng.standard_normal((1, 40, KH, D)).astype(np.float32)
  v = rng.standard_normal((1, 40, KH, D)).astype(np.float32)
  q = rng.standard_normal((1, 40, KH * G, D)).astype(np.float32)
  pos = np.arange(40, dtype=np.int32)[None]
  o, cache = cache.attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos),
                          window=None, softcap=None, scale=None, impl="xla")
  o_ref, _ = ref.attention(q, k, v, pos, pos)
  tol = TOLERANCES["float32"]["o"]
  np.testing.assert_allclose(np.asarray(o), o_ref, rtol=tol[1], atol=tol[0])
  assert cache.last_step.dense_bytes > 0 and cache.last_step.misses == 0
  # A decode step selecting every written block is exact attention over all cells.
  k1, v1, q1 = (rng.standard_normal((1, 1, h, D)).astype(np.float32) for h in (KH, KH, KH * G))
  o1, cache = cache.attend(jnp.asarray(q1), jnp.asarray(k1), jnp.asarray(v1),
                           jnp.array([[40]], np.int32), window=None, softcap=None, scale=None,
                           impl="xla")
  o1_ref, _ = ref.attention(q1, np.concatenate([k, k1], 1), np.concatenate([v, v1], 1),
                            np.array([[40]]), np.arange(41)[None])
  np.testing.assert_allclose(np.asarray(o1), o1_ref, rtol=tol[1], atol=tol[0])
  assert cache.last_step.misses == cache.filled_blocks and cache.next_position() == 41
  assert cache.room == 64 - 41


def test_bad_input_raises():
  with pytest.raises(ValueError, match="select_blocks"):
    sparse.BlockCacheConfig(device_slots=4, select_blocks=8)
  with pytest.raises(ValueError, match="window_blocks"):
    sparse.BlockCacheConfig(window_blocks=0)
  c = sparse.BlockCache.empty(1, 16, 1, 4, config=CFG, dtype=jnp.float32)
  with pytest.raises(ValueError, match="capacity"):
    c.append(jnp.zeros((1, 17, 1, 4)), jnp.zeros((1, 17, 1, 4)))
  with pytest.raises(ValueError, match="empty"):
    c.step(jnp.zeros((1, 1, 2, 4)), jnp.zeros((1, 1), jnp.int32))
  with pytest.raises(ValueError, match="manifest"):
    sparse.load("/nonexistent-dir")


def test_from_host_equals_from_arrays():
  rng = np.random.default_rng(2)
  k = rng.standard_normal((B, 45, KH, D)).astype(np.float32)
  v = rng.standard_normal((B, 45, KH, D)).astype(np.float32)
  a = sparse.BlockCache.from_arrays(jnp.asarray(k), jnp.asarray(v), config=CFG, dtype="bfloat16")
  b = sparse.BlockCache.from_host(a.store.kv.copy(), a.store.pos.copy(), config=CFG, fill=45,
                                  summary_blocks=2)  # summaries made in pieces
  np.testing.assert_array_equal(np.asarray(a.k_min), np.asarray(b.k_min))
  np.testing.assert_array_equal(np.asarray(a.k_max), np.asarray(b.k_max))
  q = jnp.asarray(rng.standard_normal((B, 1, KH * G, D)).astype(np.float32))
  p = jnp.full((B, 1), 44, jnp.int32)
  oa, la, ia, _ = a.step(q, p, impl="xla")
  ob, lb, ib, _ = b.step(q, p, impl="xla")
  np.testing.assert_array_equal(np.asarray(ia), np.asarray(ib))
  np.testing.assert_array_equal(np.asarray(oa), np.asarray(ob))


def test_pinned_and_numpy_stores_read_the_same():
  """The store in pinned_host buffers (auto on this backend: the memory kind exists) and in plain
  numpy: the same fetches, counters and outputs, bitwise; the staging buffers are reused."""
  from rkv.offload import memory
  rng = np.random.default_rng(3)
  k = jnp.asarray(rng.standard_normal((B, 70, KH, D)).astype(np.float32))
  mk = lambda host: sparse.BlockCache.empty(B, 128, KH, D, config=CFG, dtype="bfloat16",
                                            host=host).append(k, k)
  a, b = mk("pinned"), mk("numpy")
  assert a.store.pinned and not b.store.pinned
  assert {memory.memory_kind(o) for o in a.store.owners} == {"pinned_host"}
  for i in range(4):
    q = jnp.asarray(rng.standard_normal((B, 1, KH * G, D)).astype(np.float32))
    p = jnp.full((B, 1), 69, jnp.int32)
    blocks = np.stack([np.stack([np.sort(np.r_[0, 8, 1 + rng.permutation(7)[:2]])
                                 for _ in range(KH)]) for _ in range(B)]).astype(np.int32)
    oa, la, _, a = a.step(q, p, blocks=blocks, impl="xla")
    ob, lb, _, b = b.step(q, p, blocks=blocks, impl="xla")
    np.testing.assert_array_equal(np.asarray(oa), np.asarray(ob))
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
    assert a.last_step == b.last_step
    _check_slots(a)
  assert any(isinstance(key, int) for key in a.store.staging)  # a bucket's pinned staging


def _two_block_caches():
  """Two caches of one layout with different cells, so which save is on disk is clear."""
  rng = np.random.default_rng(4)
  mk = lambda: sparse.BlockCache.from_arrays(
      *(jnp.asarray(rng.standard_normal((B, 30, KH, D)).astype(np.float32)) for _ in range(2)),
      config=CFG, capacity=64, dtype="bfloat16")
  return mk(), mk()


def _assert_block_save_holds(directory, kv):
  loaded = sparse.load(str(directory))
  assert loaded.fill == kv.fill
  np.testing.assert_array_equal(loaded.store.kv, kv.store.kv)
  np.testing.assert_array_equal(loaded.store.pos, kv.store.pos)


def test_block_cache_save_keeps_what_is_there(tmp_path, monkeypatch):
  """The block cache's save runs rkv.cache's transaction. Before it did, saving into a directory
  of the user's deleted the user's files, and a failed save surfaced as a bare OSError."""
  (tmp_path / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match=r"holds \['notes.txt'\] besides a block cache save"):
    sparse.save(_two_block_caches()[0], str(tmp_path))
  assert os.listdir(tmp_path) == ["notes.txt"]
  old, new = _two_block_caches()
  directory = tmp_path / "blocks"
  sparse.save(old, str(directory))

  def full(fd):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(os, "fsync", full)
  with pytest.raises(ValueError, match="rkv.sparse.save: could not save.*No space left.*"
                                       "previous save there.*unchanged"):
    sparse.save(new, str(directory))
  monkeypatch.undo()
  _assert_block_save_holds(directory, old)
  assert [x for x in os.listdir(tmp_path) if x.startswith(".blocks.")] == []
  sparse.save(new, str(directory))  # and the next save replaces it
  _assert_block_save_holds(directory, new)


def test_block_cache_load_trusts_nothing(tmp_path):
  """A truncated, flipped, missing or foreign file, or a malformed manifest, fails with a
  ValueError naming it, never a silently different cache; a v1 save (no CRCs) still loads."""
  import json
  import shutil
  kv = _two_block_caches()[0]
  good = tmp_path / "good"
  sparse.save(kv, str(good))

  def broken(name, damage):
    d = tmp_path / name
    shutil.copytree(good, d)
    damage(d)
    return str(d)

  def flip(d):
    with open(d / "kv.npy", "r+b") as f:
      f.seek(-7, 2)
      byte = f.read(1)
      f.seek(-7, 2)
      f.write(bytes([byte[0] ^ 0x10]))
  def truncate(d):
    with open(d / "pos.npy", "r+b") as f:
      f.truncate(os.path.getsize(d / "pos.npy") - 4)
  def edit(change):
    def damage(d):
      m = json.loads((d / "manifest.json").read_text())
      change(m)
      (d / "manifest.json").write_text(json.dumps(m))
    return damage
  def foreign_dtype(d):  # same size and shape as the manifest says, other dtype: pos as float32
    np.save(d / "pos.npy", np.load(d / "pos.npy").astype(np.float32))
    m = json.loads((d / "manifest.json").read_text())
    del m["arrays"]["pos"]["crc32"]
    m["arrays"]["pos"] = m["arrays"]["pos"]["shape"]  # a v1 entry: no size or CRC to catch it
    m["version"] = 1
    (d / "manifest.json").write_text(json.dumps(m))

  cases = [
      ("flipped", flip, r"kv.npy fails its CRC-32 check"),
      ("truncated", truncate, r"pos.npy has \d+ bytes, the manifest says \d+: truncated"),
      ("missing", lambda d: os.remove(d / "kv.npy"), r"missing array file .*kv.npy"),
      ("no_fill", edit(lambda m: m.pop("fill")),
       r"missing or has a malformed field: KeyError\('fill'\)"),
      ("bad_fill", edit(lambda m: m.update(fill=10**6)), r"fill=1000000, outside"),
      ("version", edit(lambda m: m.update(version=9)), r"format version 9, this rkv reads "
                                                        r"version 1 or 2"),
      ("foreign_dtype", foreign_dtype, r"pos.npy holds float32.*stores int32.*foreign file"),
  ]
  for name, damage, match in cases:
    with pytest.raises(ValueError, match=f"rkv.sparse.load: .*{match}"):
      sparse.load(broken(name, damage))
  sparse.load(broken("flipped_unverified", flip), verify=False)  # verify=False reads it as is

  def as_v1(d):  # the format before sizes and CRCs: arrays maps each name to its shape
    m = json.loads((d / "manifest.json").read_text())
    m.update(version=1, arrays={n: s["shape"] for n, s in m["arrays"].items()})
    (d / "manifest.json").write_text(json.dumps(m))
  _assert_block_save_holds(broken("v1", as_v1), kv)
