"""Trains the needle-in-a-haystack recall model (lab/recall_train.py) with optax and saves an HF folder.

The task, the model, the curriculum and why it length-generalizes are in lab/recall_train.py. The
shipped model (rkv/assets/recall; its training_log.json holds every run's log) was made on 2 CPU
cores in four runs, 31 minutes in all: the default curriculum, then continuations on longer rows
(the 8K needle was missed near the end of the haystack until rows of 2K-4K tokens were seen).
Runs 1-3 drew their data with earlier versions of training_batch (run 1: no --adjacent_prob;
runs 2-3: a position jump was allowed before the query of an adjacent row), so re-running them
gives a similar model, not the same bits:
  .venv/bin/python -m experiments.train_recall --adjacent_prob=0 --out=/tmp/recall_final
  .venv/bin/python -m experiments.train_recall --init=/tmp/recall_final \
      --stages=500:128/256/512/1024:0.75 --lr=5e-4 --warmup=50 --out=/tmp/recall_ft
  .venv/bin/python -m experiments.train_recall --init=/tmp/recall_ft \
      --stages=150:2048/4096:0.75 --tokens_per_step=4096 --lr=3e-4 --warmup=20 \
      --adjacent_prob=0.3 --log_every=25 --eval_lengths=8192 --out=/tmp/recall_ft2
  .venv/bin/python -m experiments.train_recall --init=/tmp/recall_ft2 \
      --stages=80:4096:0.75 --tokens_per_step=4096 --lr=2e-4 --warmup=10 \
      --adjacent_prob=0.8 --log_every=10 --eval_lengths=8192 --out=rkv/assets/recall
A quick smoke run:
  .venv/bin/python -m experiments.train_recall --stages=40:32:0:0.5,20:64/128:0.5 \
      --eval_lengths=512 --eval_samples=4 --out=/tmp/recall_smoke
"""

from absl import app
from absl import flags

from lab import recall_train
from rkv import recall
from rkv import benchmarking

_T = recall_train.TrainConfig()
_S = recall.RecallModelSpec()


def _stage_str(st: recall_train.Stage) -> str:
  return f"{st.steps}:{'/'.join(str(x) for x in st.lengths)}:{st.jump_prob:g}:{st.repeat:g}"


_STAGES = flags.DEFINE_list(
    "stages", [_stage_str(st) for st in _T.stages],
    "Curriculum: STEPS:LEN[/LEN..][:SPREAD[:REPEAT]] per stage; SPREAD is the share of rows "
    "with positions spread up to --max_span (ramped in over the stage's first half), REPEAT the "
    "share of haystack pairs repeated and supervised.")
_TOKENS = flags.DEFINE_integer("tokens_per_step", _T.tokens_per_step,
                               "Tokens per step; batch = tokens_per_step // length.", lower_bound=1)
_LR = flags.DEFINE_float("lr", _T.lr, "Peak learning rate (AdamW, warm-up + cosine).")
_WARMUP = flags.DEFINE_integer("warmup", _T.warmup, "Warm-up steps.", lower_bound=0)
_QUERIES = flags.DEFINE_integer("num_queries", _T.num_queries, "Most queries per training row.",
                                lower_bound=1)
_PAIRS = flags.DEFINE_integer("max_pairs", _T.max_pairs, "Most key-value pairs per row.",
                              lower_bound=1)
_SPAN = flags.DEFINE_integer("max_span", _T.max_span,
                             "Spread rows' positions reach up to this (random jumps).",
                             lower_bound=1)
_ADJ = flags.DEFINE_float("adjacent_prob", _T.adjacent_prob,
                          "Share of rows whose last haystack pair is the first query's.")
_INIT = flags.DEFINE_string("init", None, "Continue from this saved folder's weights.")
_SEED = flags.DEFINE_integer("seed", _T.seed, "Seed of the initialization and the data.")
_LOG_EVERY = flags.DEFINE_integer("log_every", _T.log_every, "Print progress every N steps.",
                                  lower_bound=1)
_EVAL_LENGTHS = flags.DEFINE_list("eval_lengths", [str(x) for x in _T.eval_lengths],
                                  "Context lengths of the final greedy-retrieval eval.")
_EVAL_SAMPLES = flags.DEFINE_integer("eval_samples", _T.eval_samples, "Prompts per eval length.",
                                     lower_bound=1)
_LAYERS = flags.DEFINE_integer("num_layers", _S.num_layers, "Transformer layers.", lower_bound=1)
_HIDDEN = flags.DEFINE_integer("hidden_size", _S.hidden_size, "Hidden size.", lower_bound=1)
_FFN = flags.DEFINE_integer("intermediate_size", _S.intermediate_size, "MLP size.", lower_bound=1)
_HEADS = flags.DEFINE_integer("num_heads", _S.num_heads, "Query heads.", lower_bound=1)
_KV_HEADS = flags.DEFINE_integer("num_kv_heads", _S.num_kv_heads, "KV heads.", lower_bound=1)
_HEAD_DIM = flags.DEFINE_integer("head_dim", _S.head_dim, "Head dim.", lower_bound=1)
_THETA = flags.DEFINE_float("rope_theta", _S.rope_theta, "RoPE base.")
_OUT = flags.DEFINE_string("out", None, "Save the HF folder here (e.g. rkv/assets/recall).")


def _parse_stage(text: str) -> recall_train.Stage:
  parts = text.split(":")
  if len(parts) not in (2, 3, 4):
    raise ValueError(f"--stages: expected STEPS:LEN[/LEN..][:SPREAD[:REPEAT]], got {text!r}")
  return recall_train.Stage(steps=int(parts[0]), lengths=tuple(int(x) for x in parts[1].split("/")),
                      jump_prob=float(parts[2]) if len(parts) > 2 else 0.0,
                      repeat=float(parts[3]) if len(parts) > 3 else 0.0)


def main(argv):
  del argv
  # Output paths first: an unwritable one used to fail only after the whole run.
  benchmarking.check_output_path(_OUT.value, directory=True)
  spec = recall.RecallModelSpec(
      num_layers=_LAYERS.value, hidden_size=_HIDDEN.value, intermediate_size=_FFN.value,
      num_heads=_HEADS.value, num_kv_heads=_KV_HEADS.value, head_dim=_HEAD_DIM.value,
      rope_theta=_THETA.value)
  cfg = recall_train.TrainConfig(
      stages=tuple(_parse_stage(x) for x in _STAGES.value), tokens_per_step=_TOKENS.value,
      lr=_LR.value, warmup=_WARMUP.value, num_queries=_QUERIES.value, max_pairs=_PAIRS.value,
      max_span=_SPAN.value, adjacent_prob=_ADJ.value, seed=_SEED.value, log_every=_LOG_EVERY.value,
      eval_lengths=tuple(int(x) for x in _EVAL_LENGTHS.value), eval_samples=_EVAL_SAMPLES.value)
  recall_train.train(recall.RecallTask(), spec, cfg, out=_OUT.value, init=_INIT.value)


if __name__ == "__main__":
  app.run(main)
