"""Command line: python -m course_lib {generate, info, bench} ... (run with -h for the options)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
import time

from .recipes import RECIPES


def _generate(args) -> int:
    from . import device, generate, load_model

    if (args.prompt is None) == (args.prompts_file is None):
        raise ValueError("give a prompt or --prompts-file FILE (not both)")
    if args.prompts_file is not None:
        return _generate_batch(args)

    device.announce()
    model = load_model(args.model)
    out = generate(model, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, chat=args.chat, backend=args.backend,
                   recipe=args.recipe, stream=lambda piece: print(piece, end="", flush=True))
    print()
    n = len(out.token_ids)
    decode = (f"decode {out.decode_tokens_per_s:.1f} tokens/s, " if math.isfinite(out.decode_tokens_per_s)
              else "")  # one token: no decode step
    print(f"[{n} token{'s' * (n != 1)}, {out.backend} backend: {out.tokens_per_s:.1f} tokens/s overall, {decode}"
          f"prefill of {len(out.prompt_ids)} tokens {out.prefill_s * 1e3:.0f} ms; stopped by {out.stop_reason}]")
    return 0


def read_prompts(path: str) -> dict[int, str]:
    """{line number (from 1): prompt} of a file: one prompt a line, or JSON lines (a string, or an object with a
    "prompt"). A line that starts with "{" must be such an object; one that starts with a quote is read as a JSON
    string if it is one, as plain text otherwise; blank lines are skipped."""
    prompts = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith(("{", '"')):
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as e:
                    if line.lstrip().startswith("{"):
                        raise ValueError(f"{path}, line {n}: not a JSON object ({e})") from None
                    item = line  # plain text that starts with a quote
                item = item.get("prompt") if isinstance(item, dict) else item
                if not isinstance(item, str):
                    raise ValueError(f"{path}, line {n}: expected a JSON string or an object with a \"prompt\" string")
                line = item
            prompts[n] = line
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _generate_batch(args) -> int:
    from tqdm import tqdm

    from . import device, generate_batch, load_model
    from .batch import BadPromptsError

    if args.recipe is not None:
        raise ValueError("--recipe chooses the step of one sequence: --prompts-file runs generate_batch's batched step")
    device.announce()
    prompts = read_prompts(args.prompts_file)
    lines = list(prompts)  # the file's line of each prompt, in order
    model = load_model(args.model)
    bar = None  # drawn once the prompts are accepted: an error is never printed across it

    def step(_running):
        nonlocal bar
        bar = bar or tqdm(total=len(lines), unit="seq", desc="sequences", file=sys.stderr)

    def finished(i, out):
        step(None)
        bar.write(f"[line {lines[i]}] {out.text}", file=sys.stdout)
        bar.update()

    start = time.perf_counter()
    try:
        outs = generate_batch(model, list(prompts.values()), max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                              chat=args.chat, backend=args.backend, on_step=step, on_finish=finished)
    except BadPromptsError as e:
        raise ValueError(f"{args.prompts_file}: " + e.report(lambda i: f"line {lines[i]}")) from None
    finally:
        if bar is not None:
            bar.close()
    tokens, seconds = sum(len(o.token_ids) for o in outs), time.perf_counter() - start
    print(f"[{len(outs)} sequences, {tokens} tokens in {seconds:.1f} s: {tokens / seconds:.1f} tokens/s, "
          f"{outs[0].backend} backend]")
    return 0


def _info(args) -> int:
    from . import device, load_model

    device.announce()  # the sentence that says what the mode means, on stderr as every command says it
    print(f"mode: {device.mode()}")
    model = load_model(args.model)
    c = model.config
    print(f"model: {c.name} ({model.source})")
    for key, value in c.to_dict().items():
        print(f"  {key:16s} {value}")
    print(f"  {'head_dim':16s} {c.head_dim}")
    print(f"parameters: {c.n_params():,}")
    for label, size in (("f32", 4), ("bf16", 2)):
        weights = c.n_params() * size
        print(f"bytes per decoded token, {label} weights: {weights / 1e6:,.1f} MB of weights "
              f"+ {c.kv_bytes_per_position(4) / 1e3:,.1f} kB of f32 KV cache per position of context")
    return 0


def positive_ints(text: str, option: str, noun: str) -> list[int]:
    """"1,8,64" -> [1, 8, 64]; anything but positive integers is an error naming the option and the bad entry."""
    values = []
    for part in text.split(","):
        if not part.strip().isdigit() or int(part) < 1:
            raise ValueError(f"{option}: {part!r} is not {noun} (positive integers, comma-separated)")
        values.append(int(part))
    return values


def _bench_model(name: str):
    """The model `bench` measures: load_model(name), or for "random:NAME" random weights of the shapes of a known
    config (SmolLM2-135M-Instruct, Llama-3.2-1B, Llama-3.1-8B; any case)."""
    from . import load_model
    from .model import config
    from .model.tiny import random_model

    if not name.lower().startswith("random:"):
        return load_model(name)
    known = {c.name.lower(): c for c in (config.SMOLLM2_135M, config.LLAMA_32_1B, config.LLAMA_31_8B)}
    shapes = known.get(name.split(":", 1)[1].lower())
    if shapes is None:
        raise ValueError(f"{name!r}: random weights of which shapes? ({', '.join(c.name for c in known.values())})")
    return random_model(shapes)


def _bench(args) -> int:
    from . import device

    sizes = positive_ints(args.batch, "--batch", "a batch size") if args.batch is not None else None
    for option, value in (("--steps", args.steps), ("--context", args.context)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    device.announce()
    if not device.gpu_available():
        raise RuntimeError("bench measures the GPU: no CUDA GPU here (the simulator's timings mean nothing)")

    from .measure.bench import (
        batch_peers,
        batch_step_profile,
        bench_batch,
        format_batch,
        format_batch_profile,
        format_bench,
        gpu_name,
        run_bench,
    )

    model = _bench_model(args.model)
    if sizes:
        rows = bench_batch(model, sizes, args.context, args.steps, args.weights)
        peers = {} if args.no_peers else batch_peers(model.config, max(sizes), args.context, args.steps)
        print(format_batch(rows, peers, max(sizes)))
        profile = batch_step_profile(model, max(sizes), args.context, args.weights)
        print(format_batch_profile(profile))
        if args.save:
            with open(args.save, "w") as f:
                json.dump({"gpu": gpu_name(), "batch": rows, "context": args.context, "steps": args.steps,
                           "peers": peers, "peer_batch": max(sizes), "profile": profile}, f, indent=1)
        return 0
    recipes = None if args.recipes == "all" else args.recipes.split(",")
    result = run_bench(model, recipes, args.weights, args.context, args.steps, peers=not args.no_peers,
                       progress=lambda msg: print(f"... {msg}", file=sys.stderr, flush=True))
    print(format_bench(result))
    if args.save:
        with open(args.save, "w") as f:
            json.dump(result, f, indent=1)
        print(f"saved to {args.save}")
    return 0


def _recipes_epilog() -> str:
    """The recipes, a paragraph each, for generate's --help."""
    return "recipes (--recipe):\n" + "\n".join(
        textwrap.fill(f"{r.name} (notebook {r.notebook}): {r.summary}", 100, initial_indent="  ",
                      subsequent_indent="    ") for r in RECIPES.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt, streaming it", epilog=_recipes_epilog(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("prompt", nargs="?", help="the prompt (or --prompts-file)")
    g.add_argument("--prompts-file", metavar="FILE", help="many prompts, one a line (or JSON lines: a string, or an "
                   "object with a \"prompt\"), generated together; each answer is printed as it ends, after its "
                   "prompt's line number")
    g.add_argument("--model", default="SmolLM2-135M-Instruct",
                   help="the default model's name, a .gguf file or a Hugging Face directory (default: %(default)s)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="tokens to generate at most (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (the default): greedy; above 0: sampling")
    g.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K likeliest tokens only")
    g.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample among the likeliest tokens whose probabilities add up to P (0 < P <= 1)")
    g.add_argument("--seed", type=int, default=None, metavar="S", help="the same seed gives the same text")
    g.add_argument("--backend", default="auto", choices=["auto", "numpy", "cuda"],
                   help="auto (the default: the GPU if there is one), numpy or cuda")
    g.add_argument("--recipe", default=None, choices=list(RECIPES), metavar="NAME",
                   help="the CUDA recipe of one sequence's step (default: the fastest verified here; listed below)")
    g.set_defaults(run=_generate)
    i = sub.add_parser("info", help="mode (GPU or not), model config, parameters and bytes per token")
    i.add_argument("--model", default="SmolLM2-135M-Instruct", help="as for generate (default: %(default)s)")
    i.set_defaults(run=_info)
    b = sub.add_parser("bench", help="decode speed on the GPU against the bandwidth bound")
    b.add_argument("--model", default="SmolLM2-135M-Instruct",
                   help="as for generate, or random:NAME for random weights of the shapes of SmolLM2-135M-Instruct, "
                        "Llama-3.2-1B or Llama-3.1-8B (default: %(default)s)")
    b.add_argument("--recipes", default="all", help=f"comma-separated, or all: {', '.join(RECIPES)}")
    b.add_argument("--weights", default="bf16", choices=["bf16", "f32"], help="default: %(default)s")
    b.add_argument("--context", type=int, default=64, help="prompt length before the timed decode steps "
                   "(default: %(default)s)")
    b.add_argument("--steps", type=int, default=200, help="decode steps timed (default: %(default)s)")
    b.add_argument("--no-peers", action="store_true", help="skip the PyTorch peers")
    b.add_argument("--batch", metavar="SIZES", help="comma-separated batch sizes (e.g. 1,8,64): the aggregate "
                   "throughput of generate_batch instead of the recipes")
    b.add_argument("--save", metavar="FILE.json", help="keep the results (for data/)")
    b.set_defaults(run=_bench)
    args = p.parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # the reader went away (`... | head`): not an error of ours
        sys.stdout = None
        return 0
    except (ValueError, OSError, RuntimeError) as e:  # OSError: a missing file, a directory, no permission
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
