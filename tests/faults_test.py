"""rkv under faults and bad input (issue 13; README "Faults and bad input").

Each test is a promise: a stale cache, a failed or concurrent save, non-finite values to quantize
and a malformed checkpoint all raise a ValueError saying what is wrong, and never leave a wrong
answer or a destroyed save behind. (NaN propagation is in the shared attention suites:
tests/attention_test.py and tests/rolling_tactics_test.py; integer ranges beside each entry
point's other bad-input tests.)
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import rkv
from rkv import generate as gen
from rkv import models
from rkv.head_split import HeadSplitKV
from rkv.models.kv import TacticKV

STALE = "use the cache returned by the last append"
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")


def _cells(s=40, b=1, kh=2, d=16, seed=0):
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((b, s, kh, d)).astype(np.float32)
  v = rng.standard_normal((b, s, kh, d)).astype(np.float32)
  return k, v


def _cache(s=40, **kw):
  k, v = _cells(s)
  kw = dict(window_cells=10, tile_cells=8, capacity=64) | kw
  return rkv.RollingKV.from_arrays(k, v, **kw)


# ----------------------------------------------------------------------------------------------
# A stale (donated) cache: one clear ValueError at every entry point
# ----------------------------------------------------------------------------------------------
def _stale_and_live():
  kv = _cache()
  k, v = _cells(1, seed=1)
  live = kv.append(k, v)  # donates kv's window (and staging)
  return kv, live


@pytest.mark.parametrize("tactic", ["stream", "cpu", "hybrid"])
def test_stale_cache_in_rolling_attention(tactic):
  stale, live = _stale_and_live()
  q = jnp.ones((1, 1, 4, 16), jnp.float32)
  with pytest.raises(ValueError, match=f"rolling_attention: kv was deleted or donated \\({STALE}"):
    rkv.rolling_attention(q, stale, tactic=tactic, impl="xla")
  rkv.rolling_attention(q, live, tactic=tactic, impl="xla")  # the live one works


def test_stale_cache_in_append_and_save(tmp_path):
  stale, live = _stale_and_live()
  k, v = _cells(1, seed=2)
  with pytest.raises(ValueError, match=f"append: kv was deleted or donated \\({STALE}"):
    stale.append(k, v)
  with pytest.raises(ValueError, match=f"save: kv was deleted or donated \\({STALE}"):
    rkv.cache.save(stale, str(tmp_path / "c"))
  assert not (tmp_path / "c").exists(), "a refused save writes nothing"
  live.append(k, v)


def test_stale_head_split_and_tactic_caches():
  k, v = _cells()
  hs = HeadSplitKV.from_arrays(k, v, resident_heads=1, window_cells=10, tile_cells=8,
                               capacity=64)
  k1, v1 = _cells(1, seed=3)
  hs.append(k1, v1)
  q = jnp.ones((1, 1, 4, 16), jnp.float32)
  with pytest.raises(ValueError, match=STALE):
    rkv.rolling_attention(q, hs, impl="xla")
  with pytest.raises(ValueError, match=STALE):
    hs.append(k1, v1)
  tk = TacticKV(_cache(), tactic="cpu")
  tk.append(k1, v1)
  with pytest.raises(ValueError, match=STALE):
    tk.append(k1, v1)


@pytest.fixture(scope="module")
def llama():
  return models.load_hf(os.path.join(FIXTURES, "llama"), jnp.float32, impl="xla")


def test_stale_caches_in_generate(llama):
  prompt = np.arange(1, 7, dtype=np.int32)[None]
  caches = models.init_caches(llama.config, 1, 16)
  out = gen.generate(llama, prompt, max_new_tokens=2, caches=caches)
  for fn in (lambda c: gen.generate(llama, prompt, max_new_tokens=2, caches=c),
             lambda c: gen.prefill(llama, prompt, c),
             lambda c: gen.decode_logits(llama, prompt, c, prefill_len=2)):
    with pytest.raises(ValueError, match=f"caches\\[0\\] was deleted or donated \\({STALE}"):
      fn(caches)
  gen.generate(llama, prompt[:, :2], max_new_tokens=1, caches=out.caches)  # the returned ones work
