"""Block-cache decode benchmark (issue 15, lab/sparse_bench.py): one sparse layer through the
block cache vs the dense offloaded decode of the same context, composed to the Llama-3-8B
model's tok/s, each row with its bound; synthetic planted structure (see the lab module).

H200:
  .venv/bin/python -m experiments.sparse_bench \
      --contexts=262144,1048576 --slot_cells=16384,65536 --select_cells=2048,4096 \
      --out=benchmarks/results/sparse_bench_h200.json
CPU smoke run:
  .venv/bin/python -m experiments.sparse_bench --contexts=2048 --slot_cells=512 \
      --select_cells=128 --block_cells=16 --num_heads=4 --num_kv_heads=2 --head_dim=16 \
      --layers=2 --topics=4 --tile_cells=512 --dense_tactics=stream --impl=xla --warmup=1 \
      --steps=3 --out=/tmp/sb.json
"""

from absl import app, flags

from lab import sparse_bench as lab
from rkv import benchmarking

_D = lab.SparseBenchConfig()
_ints = lambda xs: tuple(int(x) for x in xs)
_CONTEXTS = flags.DEFINE_list("contexts", [str(x) for x in _D.contexts], "Context lengths.")
_SLOTS = flags.DEFINE_list("slot_cells", [str(x) for x in _D.slot_cells], "Block cache cells.")
_SELECT = flags.DEFINE_list("select_cells", [str(x) for x in _D.select_cells], "Cells read a step.")
_BLOCK = flags.DEFINE_integer("block_cells", _D.block_cells, "Cells per block.")
_HEADS = flags.DEFINE_integer("num_heads", _D.num_heads, "Query heads H.")
_KV_HEADS = flags.DEFINE_integer("num_kv_heads", _D.num_kv_heads, "KV heads K.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", _D.head_dim, "Head dim D.")
_LAYERS = flags.DEFINE_integer("layers", _D.layers, "Layers the tok/s is composed over.")
_TOPICS = flags.DEFINE_integer("topics", _D.topics, "Planted topics.")
_DENSE = flags.DEFINE_list("dense_tactics", list(_D.dense_tactics), "Dense offloaded baselines.")
_TILE = flags.DEFINE_integer("tile_cells", _D.tile_cells, "The dense tail's tile cells.")
_SELECTOR = flags.DEFINE_enum("selector", _D.selector, ["quest", "oracle"], "Block selector.")
_IMPL = flags.DEFINE_enum("impl", _D.impl, ["auto", "xla", "pallas", "reference"], "Backend.")
_WARMUP = flags.DEFINE_integer("warmup", _D.warmup, "Untimed steps.")
_STEPS = flags.DEFINE_integer("steps", _D.steps, "Timed steps (median reported).")
_TRACE = flags.DEFINE_integer("trace_steps", _D.trace_steps, "Steps of the first sparse row traced "
                               "with jax.profiler after timing (0: none).", lower_bound=0)
_OUT = flags.DEFINE_string("out", "benchmarks/results/sparse_bench_h200.json", "JSON output.")


def main(argv):
  del argv
  benchmarking.check_output_path(_OUT.value)
  cfg = lab.SparseBenchConfig(
      contexts=_ints(_CONTEXTS.value), slot_cells=_ints(_SLOTS.value),
      select_cells=_ints(_SELECT.value), block_cells=_BLOCK.value, num_heads=_HEADS.value,
      num_kv_heads=_KV_HEADS.value, head_dim=_HEAD_DIM.value, layers=_LAYERS.value,
      topics=_TOPICS.value, dense_tactics=tuple(_DENSE.value), tile_cells=_TILE.value,
      selector=_SELECTOR.value, impl=_IMPL.value, warmup=_WARMUP.value, steps=_STEPS.value,
      trace_steps=_TRACE.value)
  result = lab.run(cfg)
  print(lab.format_table(result))
  benchmarking.write_json(_OUT.value, result)


if __name__ == "__main__":
  app.run(main)
