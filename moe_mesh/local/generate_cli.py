"""`moe-mesh generate`: one prompt, through a running mesh (--gateway) or the engine in this process (--local)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

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
    p.add_argument("--checkpoint", help="HuggingFace-layout checkpoint directory (with --local)")
    p.add_argument(
        "--tls-ca",
        type=Path,
        metavar="FILE",
        help="the gateway speaks TLS: check its certificate against this CA (a ready file of "
        "`up --tls` names it itself). An API key goes in MOE_MESH_API_KEY",
    )
    p.add_argument(
        "--priority", type=int, default=0, help="higher is served first (with --gateway)"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument(
        "--prompt-token-ids", type=_token_ids, help="comma-separated prompt token ids, e.g. 1,2,3"
    )
    p.add_argument(
        "--max-tokens", type=int, default=16, help="tokens to generate at most (default 16)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1.0)"
    )
    p.add_argument(
        "--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 disables"
    )
    p.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="keep tokens at least this share of the most likely one's probability, in [0, 1]; "
        "0 disables (default)",
    )
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--stop-token-ids", type=_token_ids, default=[], help="comma-separated stop token ids"
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token"
    )
    p.add_argument(
        "--min-tokens", type=int, default=0, help="EOS and stop tokens cannot end generation sooner"
    )
    p.add_argument(
        "--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default 0: off)"
    )
    p.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (default 0: off)"
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="over prompt and output tokens, > 0 (default 1: off)",
    )
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="with --json: each token's logprob and its N (0-20) most likely alternatives",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["float32", "bfloat16", "float16", "auto"],
        help="compute dtype (default auto: the checkpoint's)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object instead of streaming text"
    )
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from moe_mesh.ops.client import client_tls

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

    settings = RouterSettings(checkpoint=args.checkpoint, dtype=args.dtype)
    checkpoint_spec(settings.checkpoint)  # before torch loads: a wrong path fails at once

    from common.tokenizer import Tokenizer
    from moe_mesh.local.generate import LocalRequest, generate_local
    from router_service.build import build_local_engine
    from router_service.engine.sampling import SamplingParams

    engine = build_local_engine(settings)
    tokenizer = Tokenizer(settings.checkpoint)  # resolved: a Hugging Face model id works too
    ids = args.prompt_token_ids if args.prompt is None else tokenizer.encode(args.prompt)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop_token_ids=tuple(args.stop_token_ids),
        ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_tokens=args.min_tokens,
        logprobs=args.logprobs,
    )
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
    from moe_mesh.ops.client import generate_remote
    from protos.moe_mesh.v1 import inference_pb2

    request = inference_pb2.GenerateRequest(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
        priority=args.priority,
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logprobs=args.logprobs is not None,
        top_logprobs=args.logprobs or 0,
    )
    if args.prompt is not None:
        request.prompt = args.prompt
    else:
        request.prompt_token_ids.extend(args.prompt_token_ids)
    if args.seed is not None:
        request.seed = args.seed
    result = asyncio.run(generate_remote(args.gateway, request, not args.json, args.tls))
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"\n[{result['finish_reason']}] {len(result['token_ids'])} tokens in {result['latency_s']:.2f}s",
            file=sys.stderr,
        )
    return 0
