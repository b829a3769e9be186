"""The device budget: the reserve kept beside the KV caches (derived from the run, term by term),
the KV budget from free memory, and the check that a plan fits this machine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rkv.offload import stream as stream_lib
from rkv.planner.layout import cell_sizes, floor_align, Sizes
from rkv.planner.profile import MIB, is_int
from rkv.planner.shape import AttentionShape

if TYPE_CHECKING:
  from rkv.planner.config import ResidencyConfig
  from rkv.planner.placement import Plan

# The device reserve: memory the run needs beside the KV caches (and the weights, which are in
# bytes_in_use by the time a plan reads free memory). It was a flat 2048 MiB plus two tiles; on
# the H200 every GiB more of window saves ~9 ms per decoded token at 1M context (Llama-3-8B), so
# it is now derived from the run (:func:`derive_reserve`), term by term:
# - Streamed tiles in flight: with a prefetcher (layered_forward's, off unless
#   $RKV_PREFETCH_TILES is set), up to this many tail tiles of the next layers on the device;
#   without one (0), the eager schedule's lookahead + 1 tiles of the layer attending, plus
#   lookahead of the next layer's with $RKV_NEXT_PUTS=1 (rkv.offload.stream.NEXT_PUTS_ENV).
DEFAULT_PREFETCH_TILES = stream_lib.DEFAULT_PREFETCH_TILES  # layered_forward's Prefetcher
# - The prefill chunk whose activations are live at once: rkv.generate.DEFAULT_CHUNK (residency
#   cannot import generate, which imports it; tests/device_memory_test.py checks they agree).
DEFAULT_CHUNK_TOKENS = 512
# - The decode kernel's float32 partials (o, lse per split, rkv/pallas/decode_attention.py): at
#   most DECODE_SPLITS splits per (batch, kv head) (its heuristic aims at ~4 x 132 programs in
#   all, so 64 bounds B*K >= 8), each of max(16, G) packed query rows (the kernel pads to 16), for
#   DECODE_LAYERS_IN_FLIGHT layers at once (a layer's partials live until its merge; the stream
#   schedule overlaps a layer's window and tail partials with the next layer's dispatch).
DECODE_SPLITS = 64
DECODE_LAYERS_IN_FLIGHT = 4
# - One prefill chunk's activations: hidden + 2 x intermediate (gate and up) + q/k/v heads per
#   token, counted in float32 (the bf16 values and their f32 upcasts) times this factor for the
#   fusions' temporaries and the chunk attention's partials.
PREFILL_ACTIVATION_FACTOR = 2
# A config without hidden_size / intermediate_size (a bare AttentionShape) gets this flat
# allowance instead (Llama-3-8B's derived term is 152 MiB at the default chunk).
PREFILL_FLAT_MIB = 512
# - The logits: [B, V] float32 (decode and the last-only prefill) and one temporary of the same
#   size (softmax / top-p sort of the sampler). A config without vocab_size counts this vocab
#   (Gemma-3's 262,208 is the largest of the supported families).
LOGITS_COPIES = 2
DEFAULT_RESERVE_VOCAB = 262_208
# - XLA/cuBLAS workspace: cuBLAS(Lt) wants up to 32 MiB a handle on Hopper, and cuDNN's and
#   XLA's scratch for fusions and autotuned GEMMs come out of the same pool. 256 MiB is an
#   allowance with room, not a measurement.
XLA_WORKSPACE_MIB = 256


@dataclasses.dataclass(frozen=True)
class Reserve:
  """Device memory kept beside the KV caches, term by term: ``terms`` is ``(name, bytes, how)``
  triples (:func:`derive_reserve`; one ``reserve_mib`` term when the config gives the figure)."""

  terms: tuple[tuple[str, int, str], ...]

  @property
  def total(self) -> int:
    return sum(b for _, b, _ in self.terms)

  def bytes_of(self, name: str) -> int:
    """One term's bytes (0 when the reserve has no such term)."""
    return sum(b for n, b, _ in self.terms if n == name)

  def describe(self) -> str:
    return " + ".join(f"{n} {b / MIB:.1f} MiB [{how}]" for n, b, how in self.terms)


def derive_reserve(shape: AttentionShape, batch: int, *, tile_cells: int,
                   prefetch_tiles: int = DEFAULT_PREFETCH_TILES,
                   chunk_tokens: int = DEFAULT_CHUNK_TOKENS, vocab_size: int | None = None,
                   hidden_size: int | None = None, intermediate_size: int | None = None,
                   tile_bytes: int | None = None, next_puts: bool | None = None) -> Reserve:
  """The device memory a run needs beside its KV caches and weights, from what it runs:

  - ``tiles``: the streamed tail tiles on the device at once: ``prefetch_tiles`` of a prefetcher's
    (when > 0), else the eager schedule's ``lookahead + 1`` of the layer attending, plus
    ``lookahead`` of the next layer's when ``next_puts`` (default ``$RKV_NEXT_PUTS``: layered_forward
    puts them while a layer waits for its CPU share); each
    ``B x tile_cells`` cells of all K heads (K/V and int8 scales; their positions are in the layout already). ``tile_bytes``
    replaces one tile's bytes (a plan's largest streamed tile; 0 when nothing streams). Capped
    like the prefetcher's own room (``rkv.offload.stream.prefetch_room``: at most
    ``DEFAULT_PREFETCH_BYTES``, at least one tile).
  - ``decode``: the decode kernel's float32 partials, ``B x K x DECODE_SPLITS x max(16, G) x
    (D + 2) x 4`` bytes a layer for ``DECODE_LAYERS_IN_FLIGHT`` layers (capped at L).
  - ``prefill``: one chunk of ``chunk_tokens`` tokens, ``B x chunk x (hidden + 2 x intermediate
    + (H + 2K) x D) x 4 x PREFILL_ACTIVATION_FACTOR`` bytes; ``PREFILL_FLAT_MIB`` when
    ``hidden_size`` or ``intermediate_size`` is unknown.
  - ``logits``: ``B x vocab x 4 x LOGITS_COPIES`` (vocab ``DEFAULT_RESERVE_VOCAB`` if unknown).
  - ``workspace``: ``XLA_WORKSPACE_MIB`` for XLA's and cuBLAS's scratch.

  Llama-3-8B, B=1, bf16, 32K-cell tiles, no prefetcher: 640 + 16.2 + 152 + 1.0 + 256 = ~1065 MiB
  (with 8 prefetched tiles 1024 MiB of tiles, ~1449 MiB; the old flat default was 2048 MiB plus two tiles, 2304 MiB). Not counted: an XLA (non-Pallas) prefill
  attention that materialises ``[chunk, S]`` scores — the library's kernels do not.
  """
  sz = cell_sizes(shape, batch)
  b, k, d, h = batch, shape.num_kv_heads, shape.head_dim, shape.query_heads
  one_tile = b * tile_cells * sz.cell if tile_bytes is None else int(tile_bytes)
  # Without a prefetcher the eager stream schedule holds lookahead + 1 tiles of a layer (and the
  # next layer's first lookahead with $RKV_NEXT_PUTS; layered_forward has no next puts with a
  # prefetcher).
  if next_puts is None:
    next_puts = stream_lib.next_puts_on()
  ahead = stream_lib.DEFAULT_LOOKAHEAD if next_puts and not prefetch_tiles else 0
  in_flight = (stream_lib.prefetch_room(one_tile, prefetch_tiles) if prefetch_tiles
               else (stream_lib.DEFAULT_LOOKAHEAD + 1 + ahead) * one_tile)
  prefetched = bool(prefetch_tiles)
  if not prefetched:
    prefetch_tiles = stream_lib.DEFAULT_LOOKAHEAD + 1 + ahead
  cap = (f", at most {stream_lib.DEFAULT_PREFETCH_BYTES / MIB:.0f} MiB"
         if stream_lib.prefetch_room(one_tile, prefetch_tiles) < prefetch_tiles * one_tile else "")
  why = "" if prefetched else (" (lookahead + 1 + lookahead of the next layer's)" if ahead
                               else " (lookahead + 1)")
  how_tile = (f"{prefetch_tiles}{why} x {tile_cells} cells x B={b} x K={k}{cap}" if tile_bytes is None
              else f"{prefetch_tiles}{why} x {one_tile} bytes, "
                   f"the plan's largest streamed tile{cap}"
              if one_tile else "nothing streams")
  layers = min(DECODE_LAYERS_IN_FLIGHT, shape.num_layers)
  rows = max(16, h // k)
  decode = b * k * DECODE_SPLITS * rows * (d + 2) * 4 * layers
  if hidden_size and intermediate_size:
    per_token = hidden_size + 2 * intermediate_size + (h + 2 * k) * d
    prefill = b * chunk_tokens * per_token * 4 * PREFILL_ACTIVATION_FACTOR
    how_prefill = (f"B={b} x {chunk_tokens} tokens x ({hidden_size} + 2 x {intermediate_size} "
                   f"+ {h + 2 * k} x {d}) x 4 x {PREFILL_ACTIVATION_FACTOR}")
  else:
    prefill = PREFILL_FLAT_MIB * MIB
    how_prefill = "flat: the config has no hidden_size / intermediate_size"
  vocab = vocab_size or DEFAULT_RESERVE_VOCAB
  logits = b * vocab * 4 * LOGITS_COPIES
  return Reserve(terms=(
      ("tiles", in_flight, how_tile),
      ("decode", decode, f"B={b} x K={k} x {DECODE_SPLITS} splits x {rows} rows x (D+2) x 4 x "
                         f"{layers} layers"),
      ("prefill", prefill, how_prefill),
      ("logits", logits, f"B={b} x V={vocab}{'' if vocab_size else ' (default)'} x 4 x "
                         f"{LOGITS_COPIES}"),
      ("workspace", XLA_WORKSPACE_MIB * MIB, "XLA/cuBLAS workspace allowance")))


def model_sizes(model_config) -> dict:
  """``vocab_size``, ``hidden_size``, ``intermediate_size`` of a config (None where absent)."""
  get = ((lambda n: model_config.get(n)) if isinstance(model_config, Mapping)
         else (lambda n: getattr(model_config, n, None)))
  out = {}
  for name in ("vocab_size", "hidden_size", "intermediate_size"):
    v = get(name)
    out[name] = int(v) if is_int(v) and v > 0 else None
  return out


def resolve_reserve(cfg: ResidencyConfig, shape: AttentionShape, batch: int, model_config=None,
                    *, tile_bytes: int | None = None, context_len: int | None = None) -> Reserve:
  """The reserve :func:`plan` keeps: ``reserve_mib`` when given, else :func:`derive_reserve` with
  the config's ``tile_cells`` (at most ``context_len``), ``prefetch_tiles`` and
  ``chunk_tokens`` and the model's vocab / hidden / intermediate sizes."""
  if cfg.reserve_mib is not None:
    return Reserve(terms=(("reserve_mib", int(cfg.reserve_mib * MIB),
                           f"reserve_mib={cfg.reserve_mib:g}"),))
  tile = cfg.tile_cells if context_len is None else min(cfg.tile_cells, floor_align(context_len))
  return derive_reserve(shape, batch, tile_cells=tile, prefetch_tiles=cfg.prefetch_tiles,
                        chunk_tokens=cfg.chunk_tokens, tile_bytes=tile_bytes,
                        **model_sizes(model_config if model_config is not None else {}))


def kv_budget_bytes(cfg: ResidencyConfig, *, memory_stats: Mapping | None = None,
                    reserve: Reserve | None = None) -> int:
  """The bytes the KV caches may use: ``vram_target_mib``, or (0) free device memory
  (``bytes_limit - bytes_in_use``) minus ``reserve`` (default: ``reserve_mib``, which is then
  required; :func:`plan` passes :func:`resolve_reserve`'s)."""
  if cfg.vram_target_mib:
    return int(cfg.vram_target_mib * MIB)
  if memory_stats is None:
    import jax
    memory_stats = jax.devices()[0].memory_stats()
  if not memory_stats or "bytes_limit" not in memory_stats:
    import jax
    raise ValueError(f"plan: vram_target_mib=0 means 'all free device memory', but the "
                     f"{jax.default_backend()} backend reports no memory stats: pass "
                     f"ResidencyConfig(vram_target_mib=...) in MiB")
  if reserve is None:
    if cfg.reserve_mib is None:
      raise ValueError("kv_budget_bytes: vram_target_mib=0 needs the reserve: pass reserve= "
                       "(rkv.planner.resolve_reserve) or ResidencyConfig(reserve_mib=...)")
    reserve = Reserve(terms=(("reserve_mib", int(cfg.reserve_mib * MIB),
                              f"reserve_mib={cfg.reserve_mib:g}"),))
  free = int(memory_stats["bytes_limit"]) - int(memory_stats.get("bytes_in_use", 0))
  budget = int(free - reserve.total)
  if budget <= 0:
    from rkv.offload import memory
    mem = memory.device_memory(memory_stats=memory_stats)
    advice = f" {memory.fraction_advice(mem)}." if _short_pool(mem) else ""
    raise ValueError(f"plan: vram_target_mib=0 leaves no KV budget: free device memory "
                     f"{free / MIB:.0f} MiB (bytes_limit {mem.bytes_limit / MIB:.0f} MiB - "
                     f"bytes_in_use {mem.bytes_in_use / MIB:.0f} MiB) minus the reserve "
                     f"{reserve.total / MIB:.0f} MiB ({reserve.describe()}); lower reserve_mib "
                     f"or free device memory.{advice}")
  return budget


def _short_pool(mem) -> bool:
  """XLA's pool may be short of the device: below LOW_FRACTION of it, or (physical size unknown)
  the fraction was not set by rkv."""
  from rkv.offload import memory
  return mem.low or (mem.limit_share is None and mem.fraction_source != memory.FRACTION_RKV)


def streamed_tile_bytes(layers, sz: Sizes) -> int:
  """The largest tile a plan's layers stream to the device (0: none streams; the cpu tactic
  attends its tail on the host)."""
  out = 0
  for lp in layers:
    if lp.tactic in ("stream", "hybrid", "head") and lp.tile_cells:
      heads = sz.heads - (lp.resident_heads or 0)
      out = max(out, sz.batch * lp.tile_cells * heads * sz.head_cell)
  return out


def check_device_fit(p: Plan, cfg: ResidencyConfig, memory_stats: Mapping,
                     worst_reserve: Reserve | None = None) -> None:
  """Raises ``ValueError`` naming ``vram_target_mib`` when the plan's device bytes plus its
  reserve exceed the free device memory of ``memory_stats``, with the figures (and the memory
  fraction advice when XLA's pool may be short of the device). The target it suggests leaves
  room for ``worst_reserve`` (default the plan's): a lower target may make a resident plan
  stream, and streamed tiles join the reserve."""
  from rkv.offload import memory
  mem = memory.device_memory(memory_stats=memory_stats)
  if mem.free is None:
    return
  need = p.device_bytes + p.reserve_bytes
  if need <= mem.free:
    return
  room = mem.free - max(p.reserve_bytes, 0 if worst_reserve is None else worst_reserve.total)
  lower = (f"Lower vram_target_mib to at most {room // MIB} MiB (or 0: all free device memory "
           f"minus the reserve)" if room >= MIB else
           "The reserve alone does not fit: free device memory first")
  advice = f" {memory.fraction_advice(mem)}." if _short_pool(mem) else ""
  raise ValueError(
      f"plan: vram_target_mib={format_number(cfg.vram_target_mib)} gives KV caches of "
      f"{format_bytes(p.device_bytes)} on the device; with the reserve of "
      f"{format_bytes(p.reserve_bytes)} ({p.reserve.describe()}) that is {format_bytes(need)}, "
      f"above the free device memory of {format_bytes(mem.free)} (bytes_limit "
      f"{mem.bytes_limit / MIB:.1f} MiB - bytes_in_use {mem.bytes_in_use / MIB:.1f} MiB). "
      f"{lower}.{advice} To plan for another machine, pass ResidencyConfig(check_free=False).")


def format_number(x) -> str:
  """A figure as the user would type it: 1048576, not 1.04858e+06."""
  return str(int(x)) if float(x).is_integer() else f"{float(x):.6g}"


def format_bytes(n: int) -> str:
  return f"{n} bytes ({n / MIB:.1f} MiB)"
