"""Summarises an ``ncu --csv --page details`` file of experiments.ncu_decode (gzipped or not):
every kernel's duration, and the decode kernel's throughput, occupancy, issue and stall figures
with ncu's findings, per call.

  python3 -m experiments.ncu_summary \\
      --csv=benchmarks/results/beyond_hbm/session11/b/ncu_decode.csv.gz
"""

import gzip

from absl import app
from absl import flags

from lab import ncu_profile

_CSV = flags.DEFINE_string("csv", None, "ncu's CSV (.gz read as gzip).", required=True)
_MATCH = flags.DEFINE_string("kernel", "rkv_decode", "Kernels whose name holds this get the "
                             "full figures.")


def main(argv):
  del argv
  opener = gzip.open if _CSV.value.endswith(".gz") else open
  with opener(_CSV.value, "rt") as f:
    print(ncu_profile.summarize(f.read(), _MATCH.value), end="")


if __name__ == "__main__":
  app.run(main)
