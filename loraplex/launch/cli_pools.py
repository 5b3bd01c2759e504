"""`loraplex pool move|drain|undrain`: the operator's moves of adapters between the pools of a base model
(service/moves.py), on the database and Redis of the deployment's settings (LORAPLEX_DATABASE_URL / LORAPLEX_HOME,
LORAPLEX_REDIS_URL)."""

from __future__ import annotations

import argparse
import sys

from loraplex.settings import get_settings


def _services():
    from loraplex.errors import InvalidRequestError
    from loraplex.service.build import build_services

    settings = get_settings()
    if not settings.redis_url:
        raise InvalidRequestError("LORAPLEX_REDIS_URL is not set: point it at the Redis the pools and gateways use")
    return build_services(settings)


def cmd_pool_move(args: argparse.Namespace) -> int:
    """Move one adapter to another live pool of its base model; waits up to --wait seconds for the hand-over."""
    from loraplex.service.moves import move_adapter, wait_placed

    services = _services()
    try:
        source = move_adapter(services, args.model_id, args.to)
        print(f"adapter {args.model_id}: move from pool {source} to pool {args.to} asked", file=sys.stderr)
        if args.wait <= 0:
            return 0
        if not wait_placed(services, args.model_id, args.to, args.wait):
            print(f"loraplex: pool {source} did not hand adapter {args.model_id} over within {args.wait:g} s (is it "
                  "running?); the move stays asked", file=sys.stderr)  # fmt: skip
            return 1
        print(f"adapter {args.model_id} is on pool {args.to}")
        return 0
    finally:
        services.redis.close()


def cmd_pool_drain(args: argparse.Namespace) -> int:
    """Drain a pool: no new adapters, each of its adapters moved to a sibling; waits up to --wait seconds."""
    from loraplex.service.moves import drain_pool, wait_drained

    services = _services()
    try:
        moves = drain_pool(services, args.name)
        for model_id, target in moves.items():
            print(f"adapter {model_id}: move from pool {args.name} to pool {target} asked", file=sys.stderr)
        left = wait_drained(services, args.name, args.wait) if moves and args.wait > 0 else list(moves)
        if left and args.wait > 0:
            print(f"loraplex: pool {args.name} did not hand {len(left)} adapter(s) over within {args.wait:g} s (is it "
                  "running?); the moves stay asked", file=sys.stderr)  # fmt: skip
            return 1
        print(f"pool {args.name} drained: {len(moves)} adapter(s) moved, no new ones placed there until "
              "`loraplex pool undrain`")  # fmt: skip
        return 0
    finally:
        services.redis.close()


def cmd_pool_undrain(args: argparse.Namespace) -> int:
    from loraplex.service.moves import undrain_pool

    services = _services()
    try:
        undrain_pool(services, args.name)
        print(f"pool {args.name} takes new adapters again")
        return 0
    finally:
        services.redis.close()


def add_parsers(sub: argparse._SubParsersAction) -> None:
    pool = sub.add_parser("pool", help="move adapters between the pools of a base model, drain a pool")
    commands = pool.add_subparsers(dest="pool_command", required=True)
    p = commands.add_parser("move", help="move one adapter to another live pool of its base model: its pool hands it "
                            "over between two plans (queued requests go with it, none applied twice) and the target "
                            "adopts it from its durable snapshot and request log")  # fmt: skip
    p.add_argument("model_id")
    p.add_argument("--to", required=True, help="the pool to move it to (a live pool of the adapter's base model)")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the hand-over (default 120; 0: "
                   "do not wait)")  # fmt: skip
    p.set_defaults(func=cmd_pool_move)
    p = commands.add_parser("drain", help="drain a pool: placement gives it no new adapter, and each of its adapters "
                            "moves to a live sibling pool of its base model (by the placement rule)")  # fmt: skip
    p.add_argument("name")
    p.add_argument("--wait", type=float, default=300.0, help="seconds to wait for every hand-over (default 300; 0: "
                   "do not wait)")  # fmt: skip
    p.set_defaults(func=cmd_pool_drain)
    p = commands.add_parser("undrain", help="let placement give a drained pool new adapters again")
    p.add_argument("name")
    p.set_defaults(func=cmd_pool_undrain)
