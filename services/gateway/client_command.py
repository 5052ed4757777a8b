"""`cbserve generate` and `cbserve health`, the command-line clients of a running gateway: their flags,
credentials and runs."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from services.common.cli_args import add_env_argument, add_max_tokens

if TYPE_CHECKING:
    from services.gateway.client import Credentials


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connecting to a gateway with TLS or API keys")
    add_env_argument(group, "--api-key", help="API key, sent as `authorization: Bearer KEY`")
    add_env_argument(
        group,
        "--tls",
        type=bool,
        default=False,
        help="connect with TLS, trusting the system's CAs unless --tls-ca is given",
    )
    add_env_argument(group, "--tls-ca", help="PEM CA certificates that issued the gateway's (implies --tls)")
    add_env_argument(group, "--tls-client-cert", help="PEM certificate to show (mutual TLS; implies --tls)")
    add_env_argument(group, "--tls-client-key", help="PEM private key of --tls-client-cert")
    add_env_argument(
        group,
        "--tls-server-name",
        help="the name the gateway's certificate must carry, when not the target's host",
    )


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_env_argument(parser, "--target", default="127.0.0.1:50051", help="gateway host:port")
    parser.add_argument("prompt", help="prompt text")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    add_max_tokens(parser, None, "most tokens to generate (default: the server's --default-max-tokens)")
    # Greedy unless asked: a command line is for trying things out, and the same prompt should give
    # the same answer. The API's own default is 1 (proto: SamplingParams.temperature).
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 is greedy; the API's default, for clients that leave it unset, is 1",
    )
    parser.add_argument("--top-p", type=float, help="nucleus sampling, in (0, 1] (default: 1, off)")
    parser.add_argument("--top-k", type=int, help="keep the k most likely tokens (default: 0, off)")
    parser.add_argument("--min-p", type=float, help="drop tokens below min_p x the top one's (default: 0)")
    parser.add_argument("--seed", type=int, help="seed of this request's sampling (default: random)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    parser.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="print each token's logprob and its N most likely alternatives (stderr)",
    )
    parser.add_argument(
        "--prompt-logprobs",
        type=int,
        metavar="N",
        help="print each prompt token's logprob (from the second) and its N most likely alternatives "
        "(stderr)",
    )
    parser.add_argument("--priority", type=int, default=0, help="higher is scheduled first")
    parser.add_argument("--cache-salt", default="", help="share cached prefixes only with this salt")
    parser.add_argument("--verbose", "-v", action="store_true", help="print the final message (stderr)")
    add_client_arguments(parser)


def add_health_arguments(parser: argparse.ArgumentParser) -> None:
    add_env_argument(parser, "--target", default="127.0.0.1:50051", help="gateway host:port")
    parser.add_argument("--service", default="", help='service name ("" = the whole server)')
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    parser.add_argument(
        "--ready-file",
        help="instead of asking a gateway: SERVING while the worker "
        "(or gateway) given this --ready-file is warm (or serves)",
    )
    add_client_arguments(parser)


def client_credentials(args: argparse.Namespace) -> Credentials:
    """The TLS files and API key of `generate` and `health`, read now: a usage error if unreadable."""
    from pathlib import Path

    from services.common.cli_args import usage_error
    from services.gateway.client import Credentials

    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise usage_error("--tls-client-cert and --tls-client-key go together")

    def pem(flag: str, path: str | None) -> bytes | None:
        try:
            return Path(path).read_bytes() if path else None
        except OSError as exc:
            raise usage_error(f"{flag} {path}: {exc.strerror}") from None

    return Credentials(
        tls=bool(args.tls or args.tls_ca or args.tls_client_cert),
        root_certificates=pem("--tls-ca", args.tls_ca),
        certificate_chain=pem("--tls-client-cert", args.tls_client_cert),
        private_key=pem("--tls-client-key", args.tls_client_key),
        server_name=args.tls_server_name,
        api_key=args.api_key,
    )


def generate_request(args: argparse.Namespace) -> Any:
    """The GenerateRequest of `cbserve generate`'s flags."""
    from services.gateway.client import completion_request

    return completion_request(
        args.prompt,
        chat=args.chat,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stops=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        priority=args.priority,
        cache_salt=args.cache_salt,
    )


def run_generate(args: argparse.Namespace) -> int:
    import grpc

    from services.gateway.client import print_logprobs, stream_to

    credentials = client_credentials(args)
    request = generate_request(args)
    try:
        final, logprobs, prompt_logprobs = stream_to(args.target, request, credentials=credentials)
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if prompt_logprobs:
        print("prompt (from its second token):", file=sys.stderr)
        print_logprobs(prompt_logprobs, sys.stderr)
    if logprobs:
        if prompt_logprobs:
            print("generated:", file=sys.stderr)
        print_logprobs(logprobs, sys.stderr)
    if final is not None and args.verbose:
        from google.protobuf.json_format import MessageToJson

        print(MessageToJson(final), file=sys.stderr)
    return 0


def run_health(args: argparse.Namespace) -> int:
    if args.ready_file:
        from pathlib import Path

        from services.common.ready_file import is_ready

        status = "SERVING" if is_ready(Path(args.ready_file)) else "NOT_SERVING"
    else:
        import grpc

        from services.gateway.client import health_status

        credentials = client_credentials(args)
        try:
            status = health_status(args.target, args.service, args.timeout, credentials)
        except grpc.RpcError as exc:
            status = exc.code().name
    print(status)
    return 0 if status == "SERVING" else 1
