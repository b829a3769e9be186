"""Host-tail machinery: memory kinds and placement (:mod:`.memory`), streamed tail attention
(:mod:`.stream`), the host-CPU attention kernel over the tail (:mod:`.cpu_attention`, built from
``cpu_kernel.c`` on first use), and, experimental, that kernel driven from inside jitted programs
by a C++ thread (:mod:`.host_share`, built from ``host_share.cc`` on first use; not imported
here, so nothing is compiled until it is used). The rolling-cache benchmark is the lab's
(``lab/rolling_bench.py``)."""

from rkv.offload.memory import (check_host_pool, hlo_report, host_compute_eqns, memory_kind,
                                placement_report, to_device, to_host)
from rkv.offload.stream import SCHEDULES, stream_attention
from rkv.offload import cpu_attention  # the module: cpu_attention.cpu_attention(...), ...tail(...)

__all__ = ["SCHEDULES", "check_host_pool", "cpu_attention", "hlo_report", "host_compute_eqns", "memory_kind",
           "placement_report", "stream_attention", "to_device", "to_host"]
