"""``pdpool`` command line: ``pdpool serve`` (a node), ``pdpool router``, ``pdpool build-kernels``, ``pdpool operator``.

Every ``serve`` flag comes from the config schema (``pdpool/config.py``); nothing is declared here twice.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from pdpool import config


def serve_config(argv: list[str]) -> config.NodeConfig:
    """``pdpool serve``'s settings: its flags over its ``--config`` YAML file (``vllm serve --config``), validated; a
    bad flag or file exits with status 2 and the error."""
    parser = argparse.ArgumentParser(prog="pdpool serve", description="Serve a model over the OpenAI API.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="The model, as vLLM's `vllm serve MODEL` takes it: the same as --model.")
    config.add_arguments(parser)
    ns = parser.parse_args(config.dashed_flags(argv))
    tag = ns.__dict__.pop("model_tag")
    if tag is not None:
        flag = getattr(ns, "model.model", None)
        if flag is not None and flag != tag:
            parser.error(f"the model is given twice, as {tag!r} and as --model {flag!r}; give it once")
        setattr(ns, "model.model", tag)
    swallowed = len(getattr(ns, "model.served_model_name", [])) > 1   # a model after the names would be the last
    try:
        path = getattr(ns, "server.config", None)
        if path is not None:
            config.merge_config_file(vars(ns), config.read_config_file(path), path)
        if swallowed and not hasattr(ns, "model.model"):
            # --served-model-name takes every value after it: a model written there would be served as a name
            parser.error("give the model as the first argument (pdpool serve MODEL --served-model-name NAME ...) "
                         "or with --model, as vllm serve asks")
        return config.from_args(ns)
    except config.ConfigError as exc:
        parser.error(str(exc))


def _serve(argv: list[str]) -> int:
    cfg = serve_config(argv)
    from pdpool.frontend import ChatTemplateError, load_chat_template
    from pdpool.models.demo import check_model

    try:   # a model or a chat template that cannot load is the command line's error, before anything listens
        check_model(cfg.model.model)
        if cfg.model.chat_template:
            load_chat_template(cfg.model.chat_template)
    except (FileNotFoundError, ChatTemplateError) as exc:
        print(f"pdpool serve: error: {exc}", file=sys.stderr)
        return 2
    from pdpool import logs
    from pdpool.node import run  # torch loads only when serving

    logs.configure()
    run(cfg)
    return 0


def _router(argv: list[str]) -> int:
    from pdpool.router.main import main as router_main  # no torch: the router only tokenizes

    return router_main(argv) or 0


def _build_kernels(argv: list[str]) -> int:
    from pdpool.kernels.build import main as build_main

    return build_main(argv) or 0


def _operator(argv: list[str]) -> int:
    from pdpool.operator.main import main as operator_main  # written by the operator; optional deps

    return operator_main(argv) or 0


COMMANDS = {
    "serve": (_serve, "serve a model over the OpenAI API (one node)"),
    "router": (_router, "run the pool's OpenAI gateway (prefix- and load-aware prefill/decode routing)"),
    "build-kernels": (_build_kernels, "build the native CPU kernels ahead of serving"),
    "operator": (_operator, "run the Kubernetes operator for InferencePool resources"),
    "up": (lambda argv: __import__("pdpool.up.main", fromlist=["main"]).main(argv),
           "run a pool (Redis, prefill and decode nodes, router) on this machine from an InferencePool YAML"),
    "status": (lambda argv: __import__("pdpool.status", fromlist=["main"]).main(argv),
               "show a running pool's nodes, load and the router's decisions, as kubectl get would"),
    "bench": (lambda argv: __import__("pdpool.bench.main", fromlist=["main"]).main(argv),
              "measure an OpenAI-compatible endpoint (TTFT, TPOT, ITL, throughput, goodput; JSON and plots)"),
    "diag": (lambda argv: __import__("pdpool.diag", fromlist=["main"]).main(argv),
             "check a KV transfer between two pods (pdpool diag kv): bytes, bandwidth, UCX transports, causes"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<10} {doc}" for name, (_, doc) in COMMANDS.items()]
        print("usage: pdpool <command> [flags]\n\ncommands:\n" + "\n".join(lines), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    run, _ = COMMANDS[argv[0]]
    try:
        return run(argv[1:])
    except KeyboardInterrupt:  # Ctrl-C is how a user stops a bench or a command still starting: no traceback
        print(f"pdpool {argv[0]}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:  # `pdpool status | head -3`: the reader left; no traceback, as a shell tool ends there
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's final flush goes nowhere
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
