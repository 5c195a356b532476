"""`moe-mesh generate`: one prompt, through a running mesh (--gateway) or the engine in this process (--local)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path

from common.cli import add_settings_arguments, flag, settings_from_args
from moe_mesh.local.settings import GenerateSettings
from moe_mesh.ops.ready import read_ready_file


def gateway_of(ready_file: Path) -> str:
    """The gateway's gRPC address in a ready file `moe-mesh up` wrote."""
    return read_ready_file(ready_file, "gateway_grpc")["gateway_grpc"]


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    _add_generate(subparsers)


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


# What the sampling flags' help adds to a field's limit (common/sampling.py); a new field needs none.
SAMPLING_HELP = {
    "max_tokens": "tokens to generate at most",
    "temperature": "0 is greedy",
    "top_p": "nucleus sampling mass; 1 disables",
    "top_k": "sample among the k most likely tokens; 0 disables",
    "min_p": "keep tokens at least this share of the most likely one's probability; 0 disables",
    "seed": "per-request sampling seed",
    "stop_token_ids": "comma-separated stop token ids",
    "ignore_eos": "keep generating past the end-of-sequence token",
    "min_tokens": "EOS and stop tokens cannot end generation sooner",
    "presence_penalty": "OpenAI's; 0 disables",
    "frequency_penalty": "OpenAI's; 0 disables",
    "repetition_penalty": "over prompt and output tokens; 1 disables",
    "logprobs": "with --json: each token's logprob and its N most likely alternatives",
}
FLAGS = {"json_output": "--json"}


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per SamplingParams field, typed, defaulted and bounded as the field is."""
    from common.sampling import SamplingParams

    hints = typing.get_type_hints(SamplingParams)
    for f in dataclasses.fields(SamplingParams):
        kind = hints[f.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        limit = f.metadata.get("range")
        help_text = ", ".join(
            x
            for x in (SAMPLING_HELP.get(f.name), f"must be {limit}" if limit else None)
            if x is not None
        )
        kwargs: dict = {
            "dest": f.name,
            "default": f.default,
            "help": f"{help_text} (default {f.default})",
        }
        if kind is bool:
            kwargs["action"] = "store_true"
        elif typing.get_origin(kind) is tuple:
            kwargs["type"] = _token_ids
        else:
            kwargs["type"] = kind
        p.add_argument(flag(f.name), **kwargs)


def sampling_from_args(args: argparse.Namespace):
    """The SamplingParams the flags give (checked where the request is served, not here)."""
    from common.sampling import SamplingParams

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingParams)}
    return SamplingParams(**{**values, "stop_token_ids": tuple(values["stop_token_ids"])})


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Generate with a running mesh (--gateway) or in this process (--local).",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--gateway", metavar="HOST:PORT", help="the gateway's gRPC address of a running mesh"
    )
    where.add_argument(
        "--ready-file",
        type=Path,
        metavar="FILE",
        help="the gateway of the mesh `moe-mesh up --ready-file FILE` started",
    )
    where.add_argument(
        "--local", action="store_true", help="run the engine in this process (needs --checkpoint)"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument(
        "--prompt-token-ids", type=_token_ids, help="comma-separated prompt token ids, e.g. 1,2,3"
    )
    add_settings_arguments(p, GenerateSettings, flags=FLAGS)
    add_sampling_arguments(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from moe_mesh.ops.client import client_tls

    settings = settings_from_args(GenerateSettings, args, flags=FLAGS)
    args = argparse.Namespace(**{**vars(args), **settings.model_dump()})
    args.json = args.json_output

    if args.ready_file:
        args.gateway = gateway_of(args.ready_file)
    args.tls = client_tls(args.ready_file, args.tls_ca)
    if args.gateway:
        return _run_generate_remote(args)
    if not args.checkpoint:
        print("moe-mesh generate: error: --local needs --checkpoint", file=sys.stderr)
        return 2
    from common.arch import checkpoint_spec
    from router_service.settings import RouterSettings

    settings = RouterSettings(checkpoint=args.checkpoint, dtype=args.dtype, device=args.device)
    checkpoint_spec(settings.checkpoint)  # before torch loads: a wrong path fails at once

    from common.tokenizer import Tokenizer
    from moe_mesh.local.generate import LocalRequest, generate_local
    from router_service.build import build_local_engine

    engine = build_local_engine(settings)
    tokenizer = Tokenizer(settings.checkpoint)  # resolved: a Hugging Face model id works too
    ids = args.prompt_token_ids if args.prompt is None else tokenizer.encode(args.prompt)
    params = sampling_from_args(args)
    request = LocalRequest("cli-0", ids, params, tuple(args.stop))

    def stream(_: str, delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    try:
        [result] = asyncio.run(
            generate_local(engine, tokenizer, [request], None if args.json else stream)
        )
    finally:
        engine.close()
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(
            f"\n[{result.finish_reason}] {len(result.token_ids)} tokens in {result.latency_s:.2f}s",
            file=sys.stderr,
        )
    return 0


def _run_generate_remote(args: argparse.Namespace) -> int:
    from common.sampling import to_proto
    from moe_mesh.ops.client import generate_remote
    from protos.moe_mesh.v1 import inference_pb2

    params = sampling_from_args(args)
    # the wire's logprobs is a flag, with the count in top_logprobs (protos/.../inference.proto)
    request = to_proto(
        dataclasses.replace(params, logprobs=None),
        inference_pb2.GenerateRequest(stop=args.stop, priority=args.priority),
    )
    request.logprobs = params.logprobs is not None
    request.top_logprobs = params.logprobs or 0
    if args.prompt is not None:
        request.prompt = args.prompt
    else:
        request.prompt_token_ids.extend(args.prompt_token_ids)
    result = asyncio.run(generate_remote(args.gateway, request, not args.json, args.tls))
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"\n[{result['finish_reason']}] {len(result['token_ids'])} tokens in {result['latency_s']:.2f}s",
            file=sys.stderr,
        )
    return 0
