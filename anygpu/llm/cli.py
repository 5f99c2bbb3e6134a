"""``anygpu generate``, ``anygpu chat`` and ``anygpu serve``: a local model folder on a device,
from the shell.

    anygpu generate ./TinyLlama --prompt "Once upon a time" --max-new-tokens 64 --device cuda
    anygpu chat ./TinyLlama --temperature 0.7 --top-p 0.9
    anygpu serve ./TinyLlama --host 127.0.0.1 --port 8000 --device cuda --max-batch 8

``chat`` streams the reply as it comes; a line ``/stats`` prints the last reply's prefill and
decode speeds (tokens/s), ``/reset`` starts a new conversation and ``/exit`` (or end of input)
leaves. ``serve`` answers OpenAI's chat and completion requests over HTTP (see
``anygpu.llm.server``), decoding up to ``--max-batch`` of them together.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a Hugging Face model folder (config.json, *.safetensors, "
                   "tokenizer.json) or a GGUF file")
    p.add_argument("--device", default=None, help='e.g. "cpu", "cuda", "opencl", "webgpu" '
                   "(default: ANYGPU_DEVICE, else cpu)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="compute dtype (default: the weights', where the device has it)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="size of the key/value cache in tokens (default: the model's, <= 4096)")
    _add_quant(p)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the text before this string (may be given more than once)")


def _add_quant(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quant", choices=["q8", "q4"], default=None,
                   help="quantize the projections' float weights at load (default: as stored)")
    p.add_argument("--group-size", type=int, choices=[32, 128], default=32,
                   help="values per scale of --quant (default 32)")


def _sampling(args: argparse.Namespace, default_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": args.max_new_tokens or default_tokens,
            "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
            "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
            "seed": args.seed, "stop": args.stop}


def _load(args: argparse.Namespace) -> Any:
    from anygpu import llm

    return llm.load(args.model, device=args.device, dtype=args.dtype,
                    max_seq_len=args.max_seq_len, quant=args.quant,
                    group_size=args.group_size)


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


def cmd_serve(args: argparse.Namespace) -> int:
    from anygpu import llm
    from anygpu.llm import ModelFolderError

    try:
        import uvicorn

        from anygpu.llm.server import build_app, warm_up
    except ImportError as err:
        print(f"anygpu serve: {err} (pip install 'anygpu[serve]')", file=sys.stderr)
        return 2
    if args.max_batch < 1 or args.max_queue < 0:
        print("anygpu serve: --max-batch must be at least 1 and --max-queue at least 0",
              file=sys.stderr)
        return 2
    try:
        lm = llm.load(args.model, device=args.device, dtype=args.dtype,
                      max_seq_len=args.max_seq_len, max_batch=args.max_batch,
                      quant=args.quant, group_size=args.group_size,
                      page_size=args.page_size, cache_tokens=args.cache_tokens)
        name = args.model_name or os.path.basename(os.path.normpath(args.model))
        app = build_app(lm, name, max_queue=args.max_queue)
    except (ModelFolderError, ValueError) as err:
        print(f"anygpu serve: {err}", file=sys.stderr)
        return 2
    print(f"{lm}: compiling the decode step", file=sys.stderr)
    warm_up(lm)
    print(f"serving '{name}' at http://{args.host}:{args.port}/v1 ({args.max_batch} slots, "
          f"{args.max_queue} may wait)", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def add_parsers(sub: Any) -> None:
    """Register ``generate``, ``chat`` and ``serve`` on the ``anygpu`` command's
    subparsers."""
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
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server for a local language "
                       "model", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a Hugging Face model folder (config.json, *.safetensors, "
                   "tokenizer.json) or a GGUF file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None, help='e.g. "cpu", "cuda", "opencl", "webgpu" '
                   "(default: ANYGPU_DEVICE, else cpu)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="compute dtype (default: the weights', where the device has it)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="tokens per sequence in the key/value cache (default: the model's, "
                   "<= 4096)")
    _add_quant(p)
    p.add_argument("--max-batch", type=int, default=8,
                   help="sequences decoded together: the cache's slots (default 8)")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per page of the key/value cache (default: --max-seq-len, "
                   "a page per sequence)")
    p.add_argument("--cache-tokens", type=int, default=None,
                   help="tokens the key/value cache holds in all, in pages that sequences "
                   "take as they grow (default: room for --max-batch full sequences)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; more are answered 429 (default 64)")
    p.add_argument("--model-name", default=None,
                   help="the name clients ask for (default: the folder's name)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)
