"""One decode-attention call as a resident decode step issues it, bracketed for Nsight Compute.

Runs ``rkv.pallas.decode_attention`` (B=1, T=1, H=32, K=8, D=128, bf16) over S keys with the
cache's explicit positions (``k_pos`` = arange, as ``ResidentCache`` passes them), warms it up, then
runs it once between ``cuProfilerStart`` / ``cuProfilerStop`` so that
``ncu --profile-from-start off`` sees exactly one call (the wrapper's fusions and the kernel) per
run; the runs share one process (JAX's start under ncu took ~80 s on the H200).

  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 \
  ncu --clock-control none --profile-from-start off --csv --page details \
      python3 benchmarks/ncu_decode.py --runs='[[2048, {}], [131072, {"block_k": 128}]]'

ncu replays each kernel and saves the memory it writes first, so the device must not be
preallocated (rkv's default takes 0.98 of it: ncu then fails with "Failed to profile").

A lab script (the library never imports it); its numbers come from ncu, not from here.
"""

import ctypes
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp


def main(argv):
  args = dict(a.lstrip("-").split("=", 1) for a in argv[1:])
  runs = json.loads(args.get("runs", "[[131072, {}]]"))
  for s, cfg in runs:
    _profile_one(int(s), cfg)


def _profile_one(s: int, cfg: dict):
  from rkv.pallas import decode_attention as dk
  bs = dataclasses.replace(dk.BlockSizes(), **cfg)
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (1, 1, 32, 128), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, s, 8, 128), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, s, 8, 128), jnp.bfloat16)
  q_pos = jnp.full((1, 1), s - 1, jnp.int32)
  k_pos = jnp.arange(s, dtype=jnp.int32)[None]
  fn = jax.jit(lambda q, k, v, q_pos, k_pos: dk.decode_attention(
      q, k, v, q_pos=q_pos, k_pos=k_pos, block_sizes=bs)[0])
  for _ in range(3):
    fn(q, k, v, q_pos, k_pos).block_until_ready()
  cuda = ctypes.CDLL("libcuda.so.1")
  cuda.cuProfilerStart()
  fn(q, k, v, q_pos, k_pos).block_until_ready()
  cuda.cuProfilerStop()
  print(f"S={s} {cfg} block_sizes={bs.resolve(batch=1, kv_heads=8, kv_len=s, rows=16, head_dim=128, kv_itemsize=2)}")


if __name__ == "__main__":
  main(sys.argv)
