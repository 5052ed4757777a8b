"""`cbserve cachemgr`: its flags and its run."""

from __future__ import annotations

import argparse

from services.common.cli_args import (
    DEFAULT_CACHEMGR_ADDRESS,
    add_cb_arguments,
    add_env_argument,
    add_model_arguments,
    model_dir,
    served_precision,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_env_argument(parser, "--cachemgr-address", default=DEFAULT_CACHEMGR_ADDRESS, help="bind address")
    add_cb_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from services.cachemgr.server import run_cachemgr

    model = model_dir(args.model)
    config, dtype = served_precision(args, model)
    return run_cachemgr(model, args.cachemgr_address, config, args.device, dtype)
