"""``ChatTokenizer``: text <-> token ids, the chat template and the stop ids of a model.

Built from a GGUF file's vocabulary (:func:`tokenizer_from_gguf_fields`): a byte-level BPE
(``tokenizer.ggml.model == "gpt2"``, what SmolLM2, Llama-3 and Qwen use) made with the
``tokenizers`` package from ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges``; control
tokens (type 3, e.g. ``<|im_start|>``) are special tokens matched whole in the text, user-defined
ones (type 4) added tokens. The pre-tokenizer splits as llama.cpp does for the file's
``tokenizer.ggml.pre``: GPT-2's regex, and for ``smollm`` every digit on its own first (the
split SmolLM2 was trained with; transformers' GGUF reader omits that step, so it differs from
llama.cpp and from SmolLM2's own tokenizer.json on runs of digits).

The chat template (``tokenizer.chat_template``, Jinja) renders as transformers renders it: a
sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception`` and the
loop controls.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

# llama.cpp token types (llama_token_type): 1 normal, 2 unknown, 3 control, 4 user-defined,
# 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4
# tokenizer.ggml.pre values whose split rkv knows (llama.cpp's llama-vocab.cpp): the GPT-2 regex,
# with "smollm" first isolating every digit.
_DIGIT_SPLIT_PRE = ("smollm",)
_GPT2_PRE = ("default", "gpt2", "gpt-2", "smollm", None)


@dataclasses.dataclass(frozen=True, eq=False)
class ChatTokenizer:
  """A ``tokenizers.Tokenizer`` with what generation needs beside it.

  ``bos_id`` / ``eos_id``: from the file (None if absent); ``add_bos``: whether :meth:`encode`
  puts ``bos_id`` first; ``stop_ids``: tokens that end a generation (EOS, and EOT / EOM when the
  file names them); ``chat_template``: Jinja source or None.
  """

  tokenizer: Any = dataclasses.field(repr=False)  # tokenizers.Tokenizer
  bos_id: int | None = None
  eos_id: int | None = None
  add_bos: bool = False
  stop_ids: tuple[int, ...] = ()
  chat_template: str | None = dataclasses.field(default=None, repr=False)

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def token(self, token_id: int | None) -> str | None:
    return None if token_id is None else self.tokenizer.id_to_token(int(token_id))

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    """Token ids of ``text``; special tokens written in it (``<|im_start|>``) map to their ids.
    ``add_bos=None``: the file's ``add_bos_token``."""
    if not isinstance(text, str):
      raise ValueError(f"ChatTokenizer.encode: text must be a str, got {type(text).__name__}")
    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    bos = self.add_bos if add_bos is None else add_bos
    if bos and self.bos_id is not None:
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

  def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *,
                          add_generation_prompt: bool = True, **kwargs) -> str:
    """The prompt text of ``messages`` (``[{"role": ..., "content": ...}]``) by the chat
    template; ``add_generation_prompt`` opens the assistant's turn."""
    where = "ChatTokenizer.apply_chat_template"
    if self.chat_template is None:
      raise ValueError(f"{where}: this tokenizer has no chat template (pass a plain prompt)")
    if isinstance(messages, (str, bytes)) or not all(
        isinstance(m, Mapping) and "role" in m and "content" in m for m in messages):
      raise ValueError(f"{where}: messages must be a list of {{'role', 'content'}} dicts")
    return _render(self.chat_template, messages=list(messages),
                   add_generation_prompt=add_generation_prompt,
                   bos_token=self.token(self.bos_id) or "",
                   eos_token=self.token(self.eos_id) or "", **kwargs)


def _render(template: str, **variables) -> str:
  import jinja2
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise ValueError(f"chat template: {message}")

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"])
  env.globals["raise_exception"] = raise_exception
  try:
    return env.from_string(template).render(**variables)
  except jinja2.TemplateError as e:
    raise ValueError(f"chat template: {type(e).__name__}: {e}") from None


def _merge_pair(m: str) -> tuple[str, str]:
  a, sep, b = m.partition(" ")
  if not sep:
    raise ValueError(f"tokenizer.ggml.merges entry {m!r} is not 'left right'")
  return a, b


def tokenizer_from_gguf_fields(fields: Mapping[str, Any], *, where: str = "load_gguf"
                               ) -> ChatTokenizer:
  """The :class:`ChatTokenizer` of a GGUF file's ``tokenizer.*`` metadata (module docstring)."""
  try:
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers
  except ImportError:
    raise ValueError(f"{where}: the tokenizer needs the 'tokenizers' package") from None
  kind = fields.get("tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"{where}: tokenizer.ggml.model={kind!r} is not supported (byte-level BPE, "
                     f"'gpt2', only)")
  pre = fields.get("tokenizer.ggml.pre")
  if pre not in _GPT2_PRE:
    raise ValueError(f"{where}: tokenizer.ggml.pre={pre!r} is not supported (known: "
                     f"{[p for p in _GPT2_PRE if p]})")
  tokens = list(fields["tokenizer.ggml.tokens"])
  types = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
  merges = [_merge_pair(m) for m in fields.get("tokenizer.ggml.merges") or ()]
  vocab = {t: i for i, t in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise ValueError(f"{where}: tokenizer.ggml.tokens has duplicate entries")

  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                        byte_fallback=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in _DIGIT_SPLIT_PRE:
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
  else:
    tok.pre_tokenizer = byte_level
  tok.decoder = decoders.ByteLevel()
  special = [tokenizers.AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types) if ty == _CONTROL]
  user = [tokenizers.AddedToken(t, special=False, normalized=False)
          for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
  tok.add_special_tokens(special)
  tok.add_tokens(user)
  if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
    raise ValueError(f"{where}: the built vocabulary has "
                     f"{tok.get_vocab_size(with_added_tokens=True)} tokens, the file {len(tokens)}")

  def tid(key):
    v = fields.get(f"tokenizer.ggml.{key}")
    return None if v is None else int(v)

  bos, eos = tid("bos_token_id"), tid("eos_token_id")
  stops = tuple(dict.fromkeys(i for i in (eos, tid("eot_token_id"), tid("eom_token_id"))
                              if i is not None))
  return ChatTokenizer(tokenizer=tok, bos_id=bos, eos_id=eos,
                       add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
                       stop_ids=stops, chat_template=fields.get("tokenizer.chat_template"))
