"""``anygpu generate`` and ``anygpu chat``: a local model folder on a device, from the shell.

    anygpu generate ./TinyLlama --prompt "Once upon a time" --max-new-tokens 64 --device cuda
    anygpu chat ./TinyLlama --temperature 0.7 --top-p 0.9

``chat`` streams the reply as it comes; a line ``/stats`` prints the last reply's prefill and
decode speeds (tokens/s), ``/reset`` starts a new conversation and ``/exit`` (or end of input)
leaves.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a Hugging Face model folder (config.json, *.safetensors, "
                   "tokenizer.json)")
    p.add_argument("--device", default=None, help='e.g. "cpu", "cuda", "opencl", "webgpu" '
                   "(default: ANYGPU_DEVICE, else cpu)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="compute dtype (default: the weights', where the device has it)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="size of the key/value cache in tokens (default: the model's, <= 4096)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the text before this string (may be given more than once)")


def _sampling(args: argparse.Namespace, default_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": args.max_new_tokens or default_tokens,
            "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
            "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
            "seed": args.seed, "stop": args.stop}


def _load(args: argparse.Namespace) -> Any:
    from anygpu import llm

    return llm.load(args.model, device=args.device, dtype=args.dtype,
                    max_seq_len=args.max_seq_len)


def cmd_generate(args: argparse.Namespace) -> int:
    from anygpu.llm import ModelFolderError

    try:
        lm = _load(args)
        print(args.prompt, end="", flush=True)
        for piece in lm.generate(args.prompt, stream=True, **_sampling(args, 128)):
            print(piece, end="", flush=True)
    except (ModelFolderError, ValueError) as err:
        print(f"\nanygpu generate: {err}", file=sys.stderr)
        return 2
    print()
    if args.stats:
        print(lm.stats, file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from anygpu.llm import ModelFolderError

    try:
        lm = _load(args)
    except (ModelFolderError, ValueError) as err:
        print(f"anygpu chat: {err}", file=sys.stderr)
        return 2
    print(f"{lm}\n/stats: speeds of the last reply, /reset: new conversation, /exit: leave")
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    first = list(messages)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        command = line.strip()
        if command == "/exit":
            return 0
        if command == "/stats":
            print(lm.stats)
            continue
        if command == "/reset":
            messages = list(first)
            lm.reset()
            print("(new conversation)")
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            for piece in lm.chat(messages, stream=True, **_sampling(args, 512)):
                print(piece, end="", flush=True)
                reply.append(piece)
        except (ModelFolderError, ValueError) as err:
            print(f"\nanygpu chat: {err}", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def add_parsers(sub: Any) -> None:
    """Register ``generate`` and ``chat`` on the ``anygpu`` command's subparsers."""
    p = sub.add_parser("generate", help="continue a prompt with a local language model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--stats", action="store_true",
                   help="print prefill and decode speeds to stderr at the end")
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("chat", help="chat with a local language model (its chat template)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(p)
    p.add_argument("--system", default=None, help="a system message to start with")
    p.set_defaults(func=cmd_chat)
