"""``ModelConfig``: one frozen description for every supported decoder-only family.

Families are presets over feature switches, not subclasses (docs/DESIGN.md §8):

| switch             | Llama-3 | Qwen2      | Qwen3      | Mistral   | Gemma-2          | Gemma-3                  |
| ------------------ | ------- | ---------- | ---------- | --------- | ---------------- | ------------------------ |
| ``layer_windows``  | None    | None [1]   | None [1]   | W (all)   | W / None alt.    | W ×5, None ×1 (pattern 6) |
| ``rope_local``     | –       | –          | –          | –         | –                | base 10k (global: 1M)    |
| ``qkv_bias``       |         | yes        |            |           |                  |                          |
| ``norm_plus_one``  |         |            |            |           | (1 + w)          | (1 + w)                  |
| ``sandwich_norms`` |         |            |            |           | post-attn/ffw    | post-attn/ffw            |
| ``qk_norm``        |         |            | w [2]      |           |                  | (1 + w)                  |
| ``embed_scale``    |         |            |            |           | × sqrt(hidden)   | × sqrt(hidden)           |
| ``query_pre_attn_scalar`` | – | –        | –          | –         | 256              | 256                      |
| softcaps           |         |            |            |           | attn 50, final 30 |                         |
| ``activation``     | silu    | silu       | silu       | silu      | gelu_tanh        | gelu_tanh                |

[1] Qwen2/Qwen3 have a sliding window on layers >= ``max_window_layers`` only when
``use_sliding_window`` is set (never in the released Qwen2.5 / Qwen3 checkpoints).
[2] Qwen3: an RMSNorm over each head's ``head_dim`` of q and of k (Llama-style weight), before
RoPE; ``head_dim`` is explicit (128 in the released models, not hidden / heads).

Every family takes the rope types of :class:`RopeConfig` (default, linear, llama3, yarn, dynamic,
longrope) from its ``rope_parameters`` / ``rope_scaling``.

``layer_windows`` is what the residency planner reads: ``None`` for a global layer (its KV cache
grows with the context), an int W for a sliding-window layer (a query at position p sees keys at
positions ``p - W < k <= p``, the HF ``sliding_window`` convention, so its cache never needs more
than W cells).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
ROPE_KINDS = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
DTYPES = ("float32", "bfloat16", "float16")

# HF architecture / model_type -> family.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # text part only
}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral",
               "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3"}

_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                   "gelu_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
                   "gelu": "gelu"}

# Keys that HF configs may omit, with the defaults of the transformers config classes (the Gemma-3
# multimodal checkpoints list only a handful of text_config keys and rely on these).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  max_position_embeddings=2048, hidden_act="silu", attention_bias=False,
                  mlp_bias=False),
    "qwen2": dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  max_position_embeddings=32768, hidden_act="silu", use_sliding_window=False,
                  sliding_window=4096, max_window_layers=28),
    "qwen3": dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  max_position_embeddings=32768, hidden_act="silu", head_dim=128,
                  attention_bias=False, use_sliding_window=False, sliding_window=4096,
                  max_window_layers=28),
    "mistral": dict(rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                    max_position_embeddings=4096 * 32, hidden_act="silu", sliding_window=4096),
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                   num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   rope_theta=10000.0, attention_bias=False, query_pre_attn_scalar=256,
                   sliding_window=4096, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0),
    "gemma3": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                   num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   rope_theta=1_000_000.0, rope_local_base_freq=10000.0, attention_bias=False,
                   query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
                   final_logit_softcapping=None, attn_logit_softcapping=None),
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")


def _err(where: str, msg: str) -> ValueError:
  return ValueError(f"{where}: {msg}")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary embedding of one layer type (HF ``rope_parameters``), computed as transformers does.

  ``kind``:

  - ``"default"``; ``"linear"`` (inverse frequencies / ``factor``, Gemma-3 global layers);
  - ``"llama3"`` (Llama-3.1 band-wise scaling with ``low_freq_factor``, ``high_freq_factor`` and
    ``original_max_position``);
  - ``"yarn"`` (Qwen3 / DeepSeek long context): frequencies blended between extrapolated and
    interpolated (``/ factor``) along a ramp set by ``beta_fast``, ``beta_slow`` and
    ``original_max_position``; cos/sin are multiplied by :attr:`attention_scaling` (the
    ``attention_factor``, else derived from ``factor``, ``mscale`` and ``mscale_all_dim``);
  - ``"longrope"`` (Phi-3 style): the frequencies divided by ``short_factor`` while a forward's
    sequence fits in ``original_max_position``, by ``long_factor`` once it does not; cos/sin
    scaled by :attr:`attention_scaling` (``attention_factor``, else
    ``sqrt(1 + ln factor / ln original_max_position)``), whichever factors are in use;
  - ``"dynamic"`` (dynamic NTK): the default frequencies up to ``original_max_position`` (HF's
    ``max_position_embeddings``), beyond it a larger base,
    ``theta * (factor * seq_len / original_max_position - (factor - 1)) ** (D / (D - 2))``.

  ``longrope`` and ``dynamic`` depend on the length of the sequence (:attr:`length_dependent`).
  Like transformers, rkv takes ``seq_len = max(positions) + 1`` of each forward call, over the
  whole batch (:func:`rkv.models.transformer.rope_tables`). One forward over the whole sequence
  therefore matches transformers exactly. With a KV cache each call rotates only its own tokens
  with its own ``seq_len``, and keys already in the cache keep the rotation they were stored with,
  which is what transformers' ``generate`` does too (it never re-rotates cached keys): the chunks
  of a prefill and every decode step see different frequencies once the sequence passes
  ``original_max_position``, so a chunked or incremental run does not equal one full forward.
  (transformers' dynamic rotary keeps the largest ``seq_len`` it has seen until a call shorter
  than ``original_max_position``; with positions growing call by call, as in generation, that is
  the same ``seq_len``.)
  """

  theta: float = 10000.0
  kind: str = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192
  # yarn / longrope: the cos/sin multiplier; None derives it from the factors as transformers does.
  attention_factor: float | None = None
  # yarn only
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True
  # longrope only: one divisor per frequency (D/2 each)
  short_factor: tuple | None = None
  long_factor: tuple | None = None

  def __post_init__(self):
    if self.kind not in ROPE_KINDS:
      raise _err("RopeConfig", f"kind must be one of {ROPE_KINDS}, got {self.kind!r}")
    if not self.theta > 0 or not self.factor > 0:
      raise _err("RopeConfig", f"theta and factor must be > 0, got {self.theta}, {self.factor}")
    if self.attention_factor is not None and not self.attention_factor > 0:
      raise _err("RopeConfig", f"attention_factor must be None or > 0, got "
                               f"{self.attention_factor!r}")
    if self.kind in ("yarn", "longrope", "dynamic", "llama3") \
        and not int(self.original_max_position) >= 1:
      raise _err("RopeConfig", f"original_max_position must be >= 1, got "
                               f"{self.original_max_position!r}")
    for name in ("short_factor", "long_factor"):
      v = getattr(self, name)
      if v is not None:  # lists (from JSON) become tuples: the config stays hashable
        v = tuple(float(x) for x in v)
        if not all(x > 0 for x in v):
          raise _err("RopeConfig", f"{name} entries must be > 0, got {v}")
        object.__setattr__(self, name, v)
    if self.kind == "longrope" and (self.short_factor is None or self.long_factor is None):
      raise _err("RopeConfig", "kind='longrope' needs short_factor and long_factor")

  @property
  def length_dependent(self) -> bool:
    """Whether the frequencies depend on the forward's sequence length (longrope, dynamic)."""
    return self.kind in ("longrope", "dynamic")

  @property
  def attention_scaling(self) -> float:
    """The factor transformers multiplies cos and sin by (1.0 but for yarn and longrope)."""
    if self.kind not in ("yarn", "longrope"):
      return 1.0
    if self.attention_factor is not None:
      return float(self.attention_factor)
    factor = self.factor
    if self.kind == "longrope":
      if factor <= 1.0:
        return 1.0
      return math.sqrt(1 + math.log(factor) / math.log(self.original_max_position))

    def mscale(scale, m=1.0):
      return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if self.mscale and self.mscale_all_dim:
      return float(mscale(factor, self.mscale) / mscale(factor, self.mscale_all_dim))
    return mscale(factor)

  def _exponents(self, head_dim: int) -> np.ndarray:
    return np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)

  def _check_factors(self, head_dim: int) -> None:
    for name in ("short_factor", "long_factor"):
      v = getattr(self, name)
      if len(v) != head_dim // 2:
        raise _err("RopeConfig", f"longrope {name} has {len(v)} entries, expected head_dim/2 = "
                                 f"{head_dim // 2}")

  def inv_freq(self, head_dim: int, seq_len: int | None = None) -> np.ndarray:
    """``[D/2]`` float32 inverse frequencies, computed as transformers does (float32 powers).

    ``seq_len`` (the forward's ``max(positions) + 1``) matters only for :attr:`length_dependent`
    kinds; None is transformers' value at initialization (short factors; the unscaled base).
    :func:`rkv.models.transformer.rope_tables` computes the same from traced positions."""
    exponents = self._exponents(head_dim)
    if self.kind == "longrope":
      self._check_factors(head_dim)
      long = seq_len is not None and seq_len > self.original_max_position
      ext = np.asarray(self.long_factor if long else self.short_factor, np.float32)
      return (np.float32(1.0) / (ext * np.float32(self.theta) ** exponents)).astype(np.float32)
    if self.kind == "dynamic" and seq_len is not None and seq_len > self.original_max_position:
      return dynamic_inv_freq(np, self, exponents, np.float32(seq_len))
    inv = (np.float32(1.0) / (np.float32(self.theta) ** exponents)).astype(np.float32)
    if self.kind == "linear":
      inv = inv / np.float32(self.factor)
    elif self.kind == "llama3":
      low_wavelen = self.original_max_position / self.low_freq_factor
      high_wavelen = self.original_max_position / self.high_freq_factor
      wavelen = 2 * math.pi / inv
      scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
      smooth = ((self.original_max_position / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor))
      smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
      medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
      inv = np.where(medium, smoothed, scaled)
    elif self.kind == "yarn":
      inv = self._yarn(head_dim, exponents)
    return inv.astype(np.float32)

  def _yarn(self, head_dim: int, exponents: np.ndarray) -> np.ndarray:
    pos_freqs = np.float32(self.theta) ** exponents
    extrapolated = np.float32(1.0) / pos_freqs
    interpolated = np.float32(1.0) / (np.float32(self.factor) * pos_freqs)

    def correction_dim(rotations):  # the dimension whose wavelength fits `rotations` times
      return (head_dim * math.log(self.original_max_position / (rotations * 2 * math.pi))
              / (2 * math.log(self.theta)))
    low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
      high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    keep = np.float32(1) - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return interpolated * (np.float32(1) - keep) + extrapolated * keep


def dynamic_inv_freq(xp, rope: "RopeConfig", exponents, seq_len):
  """Dynamic NTK's inverse frequencies for a (float32) ``seq_len`` beyond
  ``rope.original_max_position``, with ``xp`` = numpy or jax.numpy (traced ``seq_len``): the
  float32 operations of transformers' ``_compute_dynamic_ntk_parameters``."""
  f32 = xp.float32
  d = 2 * exponents.shape[0]
  grow = (f32(rope.factor) * seq_len / f32(rope.original_max_position)) - f32(rope.factor - 1)
  base = f32(rope.theta) * grow ** f32(d / (d - 2))
  return (f32(1.0) / base ** exponents).astype(f32)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer of the Llama or Gemma-2/3 family (see the module docstring).

  Read by the residency planner: ``num_layers``, ``num_kv_heads``, ``head_dim``, ``layer_windows``
  and ``dtype`` (a ``numpy.dtype``: parameters, activations and KV cache).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  layer_windows: tuple  # per layer: None (global) or the sliding window W
  rope: RopeConfig = RopeConfig()
  rope_local: RopeConfig | None = None  # sliding-window layers; None: same as ``rope``
  rms_norm_eps: float = 1e-6
  norm_plus_one: bool = False
  sandwich_norms: bool = False
  qk_norm: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  activation: str = "silu"
  embed_scale: bool = False
  query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power; None: head_dim
  attn_softcap: float | None = None
  final_softcap: float | None = None
  tie_embeddings: bool = False
  max_position_embeddings: int = 8192
  dtype: Any = "bfloat16"
  family: str = "llama"
  name: str = "custom"

  def __post_init__(self):
    where = f"ModelConfig({self.name})"
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "max_position_embeddings"):
      v = getattr(self, f)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise _err(where, f"{f} must be a positive int, got {v!r}")
    if self.num_heads % self.num_kv_heads:
      raise _err(where, f"num_heads={self.num_heads} must be a multiple of "
                        f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise _err(where, f"head_dim must be even for RoPE, got {self.head_dim}")
    windows = tuple(None if w is None else int(w) for w in self.layer_windows)
    if len(windows) != self.num_layers:
      raise _err(where, f"layer_windows must have num_layers={self.num_layers} entries, got "
                        f"{len(windows)}")
    if any(w is not None and w < 1 for w in windows):
      raise _err(where, f"layer_windows entries must be None or >= 1, got {windows}")
    object.__setattr__(self, "layer_windows", windows)
    if self.activation not in ACTIVATIONS:
      raise _err(where, f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
    if self.family not in FAMILIES:
      raise _err(where, f"family must be one of {FAMILIES}, got {self.family!r}")
    eps = self.rms_norm_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)) \
        or not (0 <= float(eps) < float("inf")):
      # A negative eps makes mean(x^2) + eps negative for small x: NaN from the rsqrt.
      raise _err(where, f"rms_norm_eps must be a finite number >= 0, got {eps!r}")
    for f in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
      v = getattr(self, f)
      if v is not None and not float(v) > 0:
        raise _err(where, f"{f} must be None or > 0, got {v!r}")
    try:
      dt = np.dtype(self.dtype)
    except TypeError:
      dt = None
    if dt is None or dt.name not in DTYPES:
      raise _err(where, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
    object.__setattr__(self, "dtype", dt)

  # --- derived ---
  @property
  def group(self) -> int:
    """G = H / K query heads per KV head."""
    return self.num_heads // self.num_kv_heads

  @property
  def attn_scale(self) -> float:
    s = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
    return float(s) ** -0.5

  @property
  def sliding_layers(self) -> tuple[int, ...]:
    return tuple(i for i, w in enumerate(self.layer_windows) if w is not None)

  @property
  def global_layers(self) -> tuple[int, ...]:
    return tuple(i for i, w in enumerate(self.layer_windows) if w is None)

  def layer_rope(self, layer: int) -> RopeConfig:
    if self.layer_windows[layer] is not None and self.rope_local is not None:
      return self.rope_local
    return self.rope

  def kv_bytes_per_token(self, layer: int | None = None) -> int:
    """K and V bytes of one token in one layer (``layer=None``: summed over all layers, global and
    sliding alike, i.e. the per-token cost before any window bound)."""
    one = 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize
    return one if layer is not None else one * self.num_layers

  def param_count(self) -> int:
    h, d = self.hidden_size, self.head_dim
    attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
    if self.qkv_bias:
      attn += d * (self.num_heads + 2 * self.num_kv_heads)
    mlp = 3 * h * self.intermediate_size
    norms = h * (4 if self.sandwich_norms else 2) + (2 * d if self.qk_norm else 0)
    head = 0 if self.tie_embeddings else self.vocab_size * h
    return self.vocab_size * h + self.num_layers * (attn + mlp + norms) + h + head

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  @classmethod
  def preset(cls, name: str, **overrides) -> "ModelConfig":
    """A named preset (``PRESETS``), optionally with fields replaced (e.g. ``dtype="float32"``)."""
    if name not in PRESETS:
      raise _err("ModelConfig.preset", f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)

  @classmethod
  def from_hf(cls, config: Mapping[str, Any], *, dtype=None, name: str | None = None
              ) -> "ModelConfig":
    """Builds the config from an HF ``config.json`` dict (transformers 4.x or 5.x layout).

    ``dtype=None`` takes the checkpoint's ``dtype``/``torch_dtype``, else bfloat16.
    """
    return _from_hf(config, dtype=dtype, name=name)


# ----------------------------------------------------------------------------------------------
# HF config.json -> ModelConfig
# ----------------------------------------------------------------------------------------------
def hf_family(config: Mapping[str, Any], where: str = "ModelConfig.from_hf") -> str:
  """The family of an HF config from ``architectures[0]``, else ``model_type``."""
  archs = config.get("architectures") or []
  if archs:
    arch = archs[0]
    if arch not in ARCHITECTURES:
      raise _err(where, f"unsupported architecture {arch!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[arch]
  mt = config.get("model_type")
  if mt not in MODEL_TYPES:
    raise _err(where, f"unsupported model_type {mt!r} (and no 'architectures'); supported: "
                      f"{sorted(MODEL_TYPES)}")
  return MODEL_TYPES[mt]


def _rope_from_params(p: Mapping[str, Any] | None, theta, max_pos: int, where: str,
                      top_original: int | None = None) -> RopeConfig:
  """One layer type's :class:`RopeConfig` from HF rope parameters, with transformers' defaults.

  ``max_pos`` is the config's ``max_position_embeddings``; ``top_original`` a top-level
  ``original_max_position_embeddings`` (Phi-3 style), which transformers prefers to the one inside
  the rope parameters."""
  p = dict(p or {})
  kind = p.get("rope_type", p.get("type", "default"))
  theta = float(p.get("rope_theta", theta))
  if float(p.get("partial_rotary_factor", 1.0)) != 1.0:
    raise _err(where, f"partial_rotary_factor={p['partial_rotary_factor']} is not supported")
  original = int(top_original or p.get("original_max_position_embeddings") or max_pos)

  def need(key):
    if p.get(key) is None:
      raise _err(where, f"rope_type {kind!r} needs {key!r} in its rope parameters")
    return p[key]
  if kind == "default":
    return RopeConfig(theta=theta)
  if kind == "linear":
    return RopeConfig(theta=theta, kind="linear", factor=float(need("factor")))
  if kind == "llama3":
    return RopeConfig(theta=theta, kind="llama3", factor=float(need("factor")),
                      low_freq_factor=float(need("low_freq_factor")),
                      high_freq_factor=float(need("high_freq_factor")),
                      original_max_position=original)
  opt = lambda key: None if p.get(key) is None else float(p[key])
  if kind == "dynamic":
    # transformers scales beyond max_position_embeddings (not original_max_position_embeddings).
    return RopeConfig(theta=theta, kind="dynamic", factor=float(need("factor")),
                      original_max_position=int(max_pos))
  if kind in ("yarn", "longrope"):
    # Without a factor both derive it from the lengths (DeepSeek-V3, Phi-3 configs).
    factor = float(p["factor"]) if p.get("factor") is not None else max_pos / original
    common = dict(theta=theta, kind=kind, factor=factor, original_max_position=original,
                  attention_factor=opt("attention_factor"))
    if kind == "yarn":
      return RopeConfig(**common, beta_fast=float(p.get("beta_fast") or 32),
                        beta_slow=float(p.get("beta_slow") or 1), mscale=opt("mscale"),
                        mscale_all_dim=opt("mscale_all_dim"),
                        truncate=bool(p.get("truncate", True)))
    return RopeConfig(**common, short_factor=tuple(need("short_factor")),
                      long_factor=tuple(need("long_factor")))
  raise _err(where, f"unsupported rope_type {kind!r}; supported: {ROPE_KINDS}")


def _ropes(d: Mapping[str, Any], family: str, where: str) -> tuple[RopeConfig, RopeConfig | None]:
  max_pos = int(d["max_position_embeddings"])
  top_original = d.get("original_max_position_embeddings")
  rope = lambda p, theta: _rope_from_params(p, theta, max_pos, where, top_original)
  rp = d.get("rope_parameters")
  if rp:  # transformers >= 5: one dict, or one per layer type
    if "full_attention" in rp or "sliding_attention" in rp:
      theta = d.get("rope_theta", 10000.0)
      glob = rope(rp.get("full_attention"), theta)
      local = rp.get("sliding_attention")
      local = None if local is None else rope(local, theta)
      return glob, (None if local == glob else local)
    return rope(rp, d.get("rope_theta", 10000.0)), None
  # transformers 4.x: rope_theta + rope_scaling (Gemma-3: scaling on global layers only, the
  # local layers use rope_local_base_freq unscaled).
  glob = rope(d.get("rope_scaling"), d["rope_theta"])
  if family == "gemma3":
    return glob, RopeConfig(theta=float(d["rope_local_base_freq"]))
  return glob, None


def _layer_windows(d: Mapping[str, Any], family: str, n: int, where: str) -> tuple:
  window = d.get("sliding_window")
  types = d.get("layer_types")
  if types is None:
    if family in ("llama",):
      types = ["full_attention"] * n
    elif family == "mistral":
      types = ["sliding_attention"] * n
    elif family in ("qwen2", "qwen3"):
      sliding = bool(d.get("use_sliding_window"))
      types = ["sliding_attention" if sliding and i >= d["max_window_layers"] else
               "full_attention" for i in range(n)]
    elif family == "gemma2":
      types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    else:  # gemma3
      pattern = int(d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6)))
      types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
  if len(types) != n:
    raise _err(where, f"layer_types has {len(types)} entries for num_hidden_layers={n}")
  out = []
  for t in types:
    if t == "full_attention" or (t == "sliding_attention" and window is None):
      out.append(None)
    elif t == "sliding_attention":
      out.append(int(window))
    else:
      raise _err(where, f"unsupported layer type {t!r} (full_attention, sliding_attention)")
  return tuple(out)


def _from_hf(config: Mapping[str, Any], *, dtype=None, name=None) -> ModelConfig:
  where = "ModelConfig.from_hf"
  if not isinstance(config, Mapping):
    raise _err(where, f"config must be a dict (an HF config.json), got {type(config).__name__}")
  family = hf_family(config, where)
  top = dict(config)
  if "text_config" in top and top.get("model_type") == "gemma3":
    top = dict(top["text_config"] or {})
  d = {**_HF_DEFAULTS[family], **{k: v for k, v in top.items() if v is not None or k in (
      "sliding_window", "final_logit_softcapping", "attn_logit_softcapping")}}
  missing = [k for k in _REQUIRED if k not in d]
  if missing:
    raise _err(where, f"config lacks {missing} for a {family} model")
  if d.get("use_bidirectional_attention"):
    raise _err(where, "use_bidirectional_attention=True is not supported (causal decoders only)")
  n = int(d["num_hidden_layers"])
  heads = int(d["num_attention_heads"])
  gemma = family in ("gemma2", "gemma3")
  act_key = "hidden_activation" if gemma and "hidden_activation" in d else "hidden_act"
  act = d.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
  if act not in _HF_ACTIVATIONS:
    raise _err(where, f"unsupported activation {act!r}; supported: {sorted(_HF_ACTIVATIONS)}")
  rope, rope_local = _ropes(d, family, where)
  if dtype is None:
    dtype = next((x for x in (top.get("dtype"), top.get("torch_dtype"), config.get("dtype"),
                              config.get("torch_dtype")) if x), "bfloat16")
    dtype = dtype if dtype in DTYPES else "bfloat16"
  attn_bias = bool(d.get("attention_bias", False))
  return ModelConfig(
      vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
      intermediate_size=int(d["intermediate_size"]), num_layers=n, num_heads=heads,
      num_kv_heads=int(d.get("num_key_value_heads") or heads),
      head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
      layer_windows=_layer_windows(d, family, n, where), rope=rope, rope_local=rope_local,
      rms_norm_eps=float(d["rms_norm_eps"]), norm_plus_one=gemma, sandwich_norms=gemma,
      qk_norm=family in ("gemma3", "qwen3"), qkv_bias=attn_bias or family == "qwen2",
      o_bias=attn_bias,
      mlp_bias=bool(d.get("mlp_bias", False)), activation=_HF_ACTIVATIONS[act],
      embed_scale=gemma,
      query_pre_attn_scalar=float(d["query_pre_attn_scalar"]) if gemma else None,
      attn_softcap=d.get("attn_logit_softcapping") if gemma else None,
      final_softcap=d.get("final_logit_softcapping") if gemma else None,
      tie_embeddings=bool(d["tie_word_embeddings"]),
      max_position_embeddings=int(d["max_position_embeddings"]), dtype=dtype, family=family,
      name=name or top.get("_name_or_path") or family)


# ----------------------------------------------------------------------------------------------
# Presets: the real sizes (from the released config.json files) and tiny ones for tests
# ----------------------------------------------------------------------------------------------
def _gemma3_windows(n: int, window: int, pattern: int = 6) -> tuple:
  return tuple(window if (i + 1) % pattern else None for i in range(n))


def _presets() -> dict[str, ModelConfig]:
  llama = dict(family="llama", dtype="bfloat16")
  gemma = dict(norm_plus_one=True, sandwich_norms=True, embed_scale=True, activation="gelu_tanh",
               tie_embeddings=True, dtype="bfloat16")
  p = {
      # meta-llama/Meta-Llama-3-8B
      "llama3-8b": ModelConfig(
          vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
          num_heads=32, num_kv_heads=8, head_dim=128, layer_windows=(None,) * 32,
          rope=RopeConfig(theta=500000.0), rms_norm_eps=1e-5, max_position_embeddings=8192,
          name="llama3-8b", **llama),
      # meta-llama/Llama-3.1-8B: same dims, llama3 RoPE scaling, 128K context
      "llama3.1-8b": ModelConfig(
          vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
          num_heads=32, num_kv_heads=8, head_dim=128, layer_windows=(None,) * 32,
          rope=RopeConfig(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position=8192),
          rms_norm_eps=1e-5, max_position_embeddings=131072, name="llama3.1-8b", **llama),
      # Qwen/Qwen2.5-1.5B
      "qwen2.5-1.5b": ModelConfig(
          vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
          num_heads=12, num_kv_heads=2, head_dim=128, layer_windows=(None,) * 28,
          rope=RopeConfig(theta=1_000_000.0), rms_norm_eps=1e-6, qkv_bias=True,
          tie_embeddings=True, max_position_embeddings=131072, family="qwen2",
          name="qwen2.5-1.5b", dtype="bfloat16"),
      # Qwen/Qwen3-8B: per-head q/k norms, head_dim 128 given explicitly, no qkv bias
      "qwen3-8b": ModelConfig(
          vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
          num_heads=32, num_kv_heads=8, head_dim=128, layer_windows=(None,) * 36,
          rope=RopeConfig(theta=1_000_000.0), rms_norm_eps=1e-6, qk_norm=True,
          max_position_embeddings=40960, family="qwen3", name="qwen3-8b", dtype="bfloat16"),
      # mistralai/Mistral-7B-v0.1 (sliding window 4096 on every layer)
      "mistral-7b": ModelConfig(
          vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
          num_heads=32, num_kv_heads=8, head_dim=128, layer_windows=(4096,) * 32,
          rope=RopeConfig(theta=10000.0), rms_norm_eps=1e-5, max_position_embeddings=32768,
          family="mistral", name="mistral-7b", dtype="bfloat16"),
      # google/gemma-2-2b: local (even) / global (odd) layers, softcaps 50 / 30
      "gemma2-2b": ModelConfig(
          vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_layers=26,
          num_heads=8, num_kv_heads=4, head_dim=256,
          layer_windows=tuple(4096 if i % 2 == 0 else None for i in range(26)),
          rope=RopeConfig(theta=10000.0), rms_norm_eps=1e-6, query_pre_attn_scalar=256,
          attn_softcap=50.0, final_softcap=30.0, max_position_embeddings=8192,
          family="gemma2", name="gemma2-2b", **gemma),
      # google/gemma-3-4b-it text part: 5 local (W=1024, base 10k) : 1 global (base 1M, linear x8)
      "gemma3-4b": ModelConfig(
          vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_layers=34,
          num_heads=8, num_kv_heads=4, head_dim=256, layer_windows=_gemma3_windows(34, 1024),
          rope=RopeConfig(theta=1_000_000.0, kind="linear", factor=8.0),
          rope_local=RopeConfig(theta=10000.0), rms_norm_eps=1e-6, qk_norm=True,
          query_pre_attn_scalar=256, max_position_embeddings=131072, family="gemma3",
          name="gemma3-4b", **gemma),
  }
  tiny = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_heads=4,
              num_kv_heads=2, head_dim=16, max_position_embeddings=512, dtype="float32")
  p["tiny-llama"] = p["llama3-8b"].replace(num_layers=2, layer_windows=(None,) * 2,
                                            name="tiny-llama", **tiny)
  p["tiny-qwen2"] = p["qwen2.5-1.5b"].replace(num_layers=2, layer_windows=(None,) * 2,
                                               name="tiny-qwen2", **tiny)
  p["tiny-qwen3"] = p["qwen3-8b"].replace(num_layers=2, layer_windows=(None,) * 2,
                                           name="tiny-qwen3", **tiny)
  p["tiny-mistral"] = p["mistral-7b"].replace(num_layers=2, layer_windows=(8,) * 2,
                                               name="tiny-mistral", **tiny)
  p["tiny-gemma2"] = p["gemma2-2b"].replace(
      num_layers=2, layer_windows=(8, None), query_pre_attn_scalar=16.0,
      name="tiny-gemma2", **{**tiny, "head_dim": 32})
  p["tiny-gemma3"] = p["gemma3-4b"].replace(
      num_layers=3, layer_windows=(6, None, 6), query_pre_attn_scalar=32.0, name="tiny-gemma3",
      **{**tiny, "num_kv_heads": 1, "head_dim": 32})
  return p


PRESETS: dict[str, ModelConfig] = _presets()
