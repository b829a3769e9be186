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
  tk = _cache().with_tactic("cpu")
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


# ----------------------------------------------------------------------------------------------
# Saving is atomic: the previous save stays loadable until a new one is complete
# ----------------------------------------------------------------------------------------------
def _two_caches():
  """Two caches of the same layout with different cells (which save is on disk is then clear)."""
  return _cache(s=37), rkv.RollingKV.from_arrays(*_cells(37, seed=9), window_cells=10,
                                                 tile_cells=8, capacity=64)


def _assert_holds(directory, kv):
  loaded = rkv.cache.load(str(directory))
  for name, x in kv.cells().items():
    if x is not None:
      np.testing.assert_array_equal(loaded.cells()[name], x)


def _leftovers(directory):
  return [x for x in os.listdir(directory.parent) if x.startswith(f".{directory.name}.")]


def _fail_fsync(monkeypatch):
  def full(fd):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(os, "fsync", full)


def _fail_mkdtemp(monkeypatch):
  def denied(*a, **kw):
    raise PermissionError(13, "Permission denied")
  monkeypatch.setattr(rkv.atomic_io.tempfile, "mkdtemp", denied)


def _fail_second_array(monkeypatch):
  real = rkv.cache._cell_chunks
  def chunks(kv, name):
    if name == "v":
      raise OSError(5, "Input/output error")
    yield from real(kv, name)
  monkeypatch.setattr(rkv.cache, "_cell_chunks", chunks)


@pytest.mark.parametrize("fault,why", [(_fail_fsync, "No space left"),
                                       (_fail_mkdtemp, "Permission denied"),
                                       (_fail_second_array, "Input/output error")],
                         ids=["disk_full", "unwritable", "write_fails_midway"])
def test_failed_save_keeps_the_previous_one(tmp_path, monkeypatch, fault, why):
  # Before: save rewrote k.bin, v.bin, ... in place, so a failure midway left neither save.
  old, new = _two_caches()
  directory = tmp_path / "cache"
  rkv.cache.save(old, str(directory))
  fault(monkeypatch)
  with pytest.raises(ValueError, match=f"could not save.*{why}.*previous save there.*unchanged"):
    rkv.cache.save(new, str(directory))
  monkeypatch.undo()
  _assert_holds(directory, old)
  assert _leftovers(directory) == []
  rkv.cache.save(new, str(directory))  # and the next save replaces it
  _assert_holds(directory, new)


def test_exception_midway_keeps_the_previous_one(tmp_path, monkeypatch):
  old, new = _two_caches()
  directory = tmp_path / "cache"
  rkv.cache.save(old, str(directory))
  monkeypatch.setattr(rkv.atomic_io, "install", lambda tmp, target: 1 / 0)
  with pytest.raises(ZeroDivisionError):
    rkv.cache.save(new, str(directory))
  monkeypatch.undo()
  _assert_holds(directory, old)
  assert _leftovers(directory) == []


_KILLED_WRITER = """
import os, signal, sys
import numpy as np
import rkv
from rkv import cache
rng = np.random.default_rng(9)
k, v = (rng.standard_normal((1, 37, 2, 16)).astype(np.float32) for _ in range(2))
kv = rkv.RollingKV.from_arrays(k, v, window_cells=10, tile_cells=8, capacity=64)
real = cache._cell_chunks
def chunks(kv, name):
  if name == "v":  # k.bin is written: the writer dies in the middle of the save
    os.kill(os.getpid(), signal.SIGKILL)
  yield from real(kv, name)
cache._cell_chunks = chunks
cache.save(kv, sys.argv[1])
"""


def test_killed_writer_keeps_the_previous_one(tmp_path):
  import subprocess
  import sys
  old, _ = _two_caches()
  directory = tmp_path / "cache"
  rkv.cache.save(old, str(directory))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(directory)], cwd=root,
                        capture_output=True, timeout=300)
  assert proc.returncode == -9, proc.stderr.decode()[-2000:]
  _assert_holds(directory, old)


def test_concurrent_saves_each_install_a_whole_save(tmp_path, monkeypatch):
  # Both savers finish writing before either installs (a barrier), then install at once: the
  # directory holds one of the two saves whole, never a mix (before: one shared temp manifest
  # name and in-place data files).
  import threading
  a, b = _two_caches()
  directory = tmp_path / "cache"
  rkv.cache.save(a, str(directory))
  barrier = threading.Barrier(2, timeout=60)
  real = rkv.atomic_io.install
  temps = []
  def install(tmp, target):
    temps.append(tmp)
    barrier.wait()
    real(tmp, target)
  monkeypatch.setattr(rkv.atomic_io, "install", install)
  errors = []
  def run(kv):
    try:
      rkv.cache.save(kv, str(directory))
    except Exception as e:  # pragma: no cover - reported below
      errors.append(e)
  threads = [threading.Thread(target=run, args=(kv,)) for kv in (a, b)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert errors == [] and len(set(temps)) == 2, (errors, temps)
  loaded = rkv.cache.load(str(directory)).cells()["k"]
  assert any(np.array_equal(loaded, kv.cells()["k"]) for kv in (a, b))
  _assert_holds(directory, a if np.array_equal(loaded, a.cells()["k"]) else b)
  assert _leftovers(directory) == []


# ----------------------------------------------------------------------------------------------
# One-file writes (checkpoints, profiles, results JSON) are atomic too
# ----------------------------------------------------------------------------------------------
def _writing_leftovers(folder):
  return [x for x in os.listdir(folder) if ".writing-" in x]


def test_failed_file_writes_keep_the_previous_file(tmp_path, monkeypatch):
  # Before: save_safetensors, write_json and Profile.save wrote the target in place (the profile
  # through one fixed ".tmp" name), so a failure midway left a truncated checkpoint or result.
  from rkv import benchmarking
  from rkv.planner import Profile
  ckpt, out, prof = (str(tmp_path / n) for n in ("m.safetensors", "r.json", "p.json"))
  w = np.arange(12, dtype=np.float32).reshape(3, 4)
  models.save_safetensors(ckpt, {"w": w})
  benchmarking.write_json(out, {"rows": [1, 2]})
  profile = Profile(pcie_gbps=50.0, d2h_gbps=50.0, hbm_gbps=1000.0)
  profile.save(prof)
  mode = 0o666 & ~rkv.atomic_io._umask()
  assert {os.stat(p).st_mode & 0o777 for p in (ckpt, out, prof)} == {mode}  # as a new file's

  def full(fd):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(os, "fsync", full)
  with pytest.raises(OSError, match="No space left"):
    models.save_safetensors(ckpt, {"w": np.zeros((5, 5), np.float32)})
  with pytest.raises(OSError, match="No space left"):
    Profile(pcie_gbps=1.0, d2h_gbps=1.0, hbm_gbps=1.0).save(prof)
  monkeypatch.undo()
  with pytest.raises(TypeError, match="keys must be"):  # json.dump fails after writing a part
    benchmarking.write_json(out, {"rows": [3], "bad": {(1, 2): 0}})
  np.testing.assert_array_equal(models.read_safetensors(ckpt)["w"], w)
  with open(out) as f:
    assert f.read() == '{\n "rows": [\n  1,\n  2\n ]\n}\n'
  assert Profile.load(prof).pcie_gbps == 50.0
  assert _writing_leftovers(tmp_path) == []
  # A symlinked results file stays a symlink: the file it points to gets the new contents.
  os.makedirs(tmp_path / "real")
  os.symlink(tmp_path / "real" / "r.json", tmp_path / "link.json")
  benchmarking.write_json(str(tmp_path / "link.json"), {"rows": []})
  assert os.path.islink(tmp_path / "link.json")
  with open(tmp_path / "real" / "r.json") as f:
    assert f.read() == '{\n "rows": []\n}\n'


def test_save_refuses_to_replace_a_directory_holding_other_files(tmp_path):
  (tmp_path / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match=r"holds \['notes.txt'\] besides an rkv save"):
    rkv.cache.save(_cache(), str(tmp_path))
  assert os.listdir(tmp_path) == ["notes.txt"]
  (tmp_path / "file").write_text("")
  with pytest.raises(ValueError, match="not a directory"):
    rkv.cache.save(_cache(), str(tmp_path / "file"))


def test_save_into_an_empty_directory_and_over_a_save(tmp_path):
  rkv.cache.save(_cache(), str(tmp_path))  # pytest's tmp_path exists, empty
  kv = _two_caches()[1]
  rkv.cache.save(kv, str(tmp_path))
  _assert_holds(tmp_path, kv)
  assert sorted(os.listdir(tmp_path)) == ["k.bin", "manifest.json", "pos.bin", "v.bin"]


# ----------------------------------------------------------------------------------------------
# int8 quantization of non-finite K/V is refused with the cell named
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("field", ["k", "v"])
def test_int8_cache_refuses_non_finite_cells(bad, field):
  # Before: NaN got scale 1.0 (a silently wrong row), inf a scale of inf.
  k, v = _cells(40, b=2)
  pos = np.broadcast_to(np.arange(100, 140, dtype=np.int32), (2, 40)).copy()
  (k if field == "k" else v)[1, 27, 1, 5] = bad
  want = (f"{field} holds {bad} at batch row 1, cell 27, position 127, kv head 1: an int8 cache "
          f"cannot represent")
  with pytest.raises(ValueError, match=want.replace("(", r"\(")):
    rkv.RollingKV.from_arrays(k, v, window_cells=10, tile_cells=8, k_pos=pos, dtype=jnp.int8)
  with pytest.raises(ValueError, match="batch row 1, cell 27"):
    HeadSplitKV.from_arrays(k, v, resident_heads=1, window_cells=10, tile_cells=8,
                            k_pos=pos, dtype=jnp.int8)
  kv = rkv.RollingKV.empty(2, 64, 2, 16, window_cells=10, tile_cells=8, dtype=jnp.int8)
  with pytest.raises(ValueError, match=f"append: {field} holds .* cell 27, position 27, kv head 1"):
    kv.append(k, v)
  kv.append(np.nan_to_num(k, posinf=0, neginf=0), np.nan_to_num(v, posinf=0, neginf=0))


def test_int8_append_of_device_values_keeps_non_finite_rows_loud():
  # Device values are not read back per step; the quantized row must then read as NaN, never
  # as a finite wrong row.
  k, v = _cells(3)
  k[0, 1, 0, 2] = np.nan
  kv = rkv.RollingKV.empty(1, 16, 2, 16, window_cells=8, tile_cells=8, dtype=jnp.int8)
  kv = kv.append(jnp.asarray(k), jnp.asarray(v))
  assert np.isnan(np.asarray(kv.window.k_scale)[0, 1, 0])
  o, _ = rkv.rolling_attention(jnp.ones((1, 1, 4, 16), jnp.float32), kv, impl="xla")
  assert np.isnan(np.asarray(o)[0, 0, :2]).all() and np.isfinite(np.asarray(o)[0, 0, 2:]).all()


# ----------------------------------------------------------------------------------------------
# Malformed checkpoints: a ValueError naming the file and what is wrong
# ----------------------------------------------------------------------------------------------
def _write_header(path, header, data=b""):
  blob = header if isinstance(header, bytes) else __import__("json").dumps(header).encode()
  with open(path, "wb") as f:
    f.write(len(blob).to_bytes(8, "little") + blob + data)


GOOD = dict(dtype="F32", shape=[2, 2], data_offsets=[0, 16])
BAD_HEADERS = [
    ("list_header", [1, 2], "header must be a JSON object"),
    ("entry_not_object", {"w": [1]}, "tensor 'w': header entry must be an object"),
    ("missing_shape", {"w": dict(dtype="F32", data_offsets=[0, 16])}, r"missing \['shape'\]"),
    ("missing_offsets", {"w": dict(dtype="F32", shape=[2, 2])}, r"missing \['data_offsets'\]"),
    ("missing_dtype", {"w": dict(shape=[2, 2], data_offsets=[0, 16])}, r"missing \['dtype'\]"),
    ("shape_not_ints", {"w": dict(GOOD, shape=["2", 2])}, "shape must be a list of non-negative"),
    ("negative_dim", {"w": dict(GOOD, shape=[-2, -2])}, "shape must be a list of non-negative"),
    ("offsets_three", {"w": dict(GOOD, data_offsets=[0, 8, 16])}, "data_offsets must be"),
    ("dtype_not_string", {"w": dict(GOOD, dtype=["F32"])}, "unsupported dtype"),
    ("size_disagrees_with_dtype", {"w": dict(GOOD, dtype="F16")}, r"do not hold \(2, 2\) F16"),
    ("overlap", {"a": GOOD, "b": dict(GOOD, data_offsets=[8, 24])}, "'a' and 'b' overlap"),
    ("non_utf8", b'{"w": "\xff\xfe"}', "header is not UTF-8 text"),
]


@pytest.mark.parametrize("header,match", [b[1:] for b in BAD_HEADERS],
                         ids=[b[0] for b in BAD_HEADERS])
def test_malformed_safetensors_header(tmp_path, header, match):
  # Before: AttributeError/KeyError/TypeError from inside the reader, or overlapping tensors read.
  path = str(tmp_path / "model.safetensors")
  _write_header(path, header, bytes(32))
  with pytest.raises(ValueError, match=f"read_safetensors\\({path}\\): .*{match}"):
    models.read_safetensors(path)


def _copy(arch, tmp_path):
  import shutil
  dst = tmp_path / arch
  shutil.copytree(os.path.join(FIXTURES, arch), dst)
  return dst


@pytest.mark.parametrize("index,match", [
    (b"[]", "must be a JSON object with a weight_map"),
    (b'{"metadata": {}}', "needs a weight_map object"),
    (b'{"weight_map": ["a"]}', "needs a weight_map object"),
    (b'{"weight_map": {"w": 3}}', "maps tensor 'w' to 3"),
    (b'{"weight_map": {"w": "../model.safetensors"}}', "maps tensor 'w' to '../model"),
    (b'{"weight_map": {', "is not valid JSON"),
    (b'{"weight_map": "\xc3\x28"}', "is not UTF-8 text"),
], ids=["list", "no_map", "map_list", "file_not_str", "outside_folder", "truncated", "non_utf8"])
def test_malformed_shard_index(tmp_path, index, match):
  path = _copy("qwen2", tmp_path)
  (path / "model.safetensors.index.json").write_bytes(index)
  with pytest.raises(ValueError, match=f"load_hf\\({path}\\): model.safetensors.index.json.*{match}"):
    models.load_hf(str(path))


@pytest.mark.parametrize("config,match", [
    (b'{"architectures": ["LlamaForCausalLM"], "name": "caf\xe9"}', "config.json is not UTF-8 text"),
    (b"[1, 2]", "config.json must be a JSON object"),
    (b"{", "config.json is not valid JSON"),
], ids=["non_utf8", "not_object", "truncated"])
def test_malformed_config(tmp_path, config, match):
  path = _copy("llama", tmp_path)
  (path / "config.json").write_bytes(config)
  with pytest.raises(ValueError, match=f"load_hf\\({path}\\): {match}"):
    models.load_hf(str(path))


def test_config_with_fewer_layers_than_the_checkpoint_is_refused(tmp_path):
  import json
  path = _copy("llama", tmp_path)
  d = json.loads((path / "config.json").read_text())
  n = d["num_hidden_layers"]
  d["num_hidden_layers"] = n - 1
  (path / "config.json").write_text(json.dumps(d))
  with pytest.raises(ValueError, match=f"num_hidden_layers={n - 1} but the checkpoint holds "
                                       f"layers up to {n - 1}"):
    models.load_hf(str(path))


# ----------------------------------------------------------------------------------------------
# Experiment scripts check their flags and outputs before the work starts
# ----------------------------------------------------------------------------------------------
def test_check_output_path(tmp_path):
  from rkv import benchmarking
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  with pytest.raises(ValueError, match=r"--out='.*a_file/r.json' cannot be written"):
    benchmarking.check_output_path(str(blocker / "r.json"))
  with pytest.raises(ValueError, match="--plot=.* is a directory"):
    benchmarking.check_output_path(str(tmp_path), "plot")
  with pytest.raises(ValueError, match="exists and is not a directory"):
    benchmarking.check_output_path(str(blocker), directory=True)
  benchmarking.check_output_path(str(tmp_path / "new" / "r.json"))  # folder created, no file left
  assert os.listdir(tmp_path / "new") == []
  benchmarking.check_output_path(None)


def test_results_record_the_switches_that_were_set(monkeypatch):
  # A result's environment names the rkv / XLA switches set for its run (an A/B's two files
  # say which side each is), and nothing else from the environment.
  from rkv import benchmarking
  monkeypatch.setenv("RKV_NEXT_PUTS", "1")
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  monkeypatch.setenv("SOME_SECRET_TOKEN", "x")
  env = benchmarking.environment()["env"]
  assert env["RKV_NEXT_PUTS"] == "1" and env["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer="
  assert "SOME_SECRET_TOKEN" not in env and all(
      k.startswith(benchmarking.RECORDED_ENV_PREFIXES) for k in env)


@pytest.mark.parametrize("args,match", [
    (["--out={blocker}/r.json"], "--out=.* cannot be written"),  # before: after the whole run
    (["--n_outer=0"], "n_outer"),  # before: a numpy error on an empty list of timings
], ids=["unwritable_out", "bad_count"])
def test_experiment_script_refuses_up_front(tmp_path, args, match):
  import re
  import subprocess
  import sys
  import time
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "experiments.kernel_bench", "--quick",
                         *(a.format(blocker=blocker) for a in args)], cwd=root,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  assert re.search(match, proc.stderr + proc.stdout), proc.stderr[-2000:]
  assert "self-check" not in proc.stdout  # no benchmark ran
  assert time.perf_counter() - t0 < 120
