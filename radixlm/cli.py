"""`radixlm serve ...` and `radixlm generate "prompt"`."""

from __future__ import annotations

import argparse
import logging
import sys

from radixlm.config import ServerArgs


def _generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="radixlm generate",
                                     description="Generate text with the offline engine.")
    parser.add_argument("prompt", help="The prompt (or the user message with --chat)")
    parser.add_argument("--chat", action="store_true", help="Apply the model's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--stream", action="store_true", help="Print tokens as they come")
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(message)s")
    from radixlm.engine import Engine

    engine = Engine(**{k: v for k, v in vars(ServerArgs.from_cli_args(args)).items()})
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.stream:
        for chunk in engine.generate(prompt, sp, stream=True):
            print(chunk["text"], end="", flush=True)
        print()
    else:
        print(engine.generate(prompt, sp)["text"])
    engine.shutdown()
    return 0


def _serve(argv: list[str]) -> int:
    from radixlm.server.launch import main as serve_main
    return serve_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"serve": _serve, "generate": _generate}
    if not argv or argv[0] not in commands:
        print("usage: radixlm {serve,generate} [options]  (radixlm COMMAND --help)")
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
