"""The `loraplex` command: serve the stack, manage tenants, export adapters, run the demo."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from loraplex.settings import Settings, get_settings


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {}
    if getattr(args, "base_model", None):
        overrides["base_model"] = args.base_model
    if getattr(args, "port", None):
        overrides["api_port"] = args.port
    return get_settings().model_copy(update=overrides)


def cmd_migrate(args: argparse.Namespace) -> int:
    from loraplex.storage.db import migrate

    settings = _settings(args)
    settings.home.mkdir(parents=True, exist_ok=True)
    migrate(settings.resolved_database_url)
    print(f"database at head: {settings.resolved_database_url}")
    return 0


def _tenant_repo_session(settings: Settings):
    from loraplex.storage.db import make_db_engine, migrate, session_factory

    settings.home.mkdir(parents=True, exist_ok=True)
    migrate(settings.resolved_database_url)
    return session_factory(make_db_engine(settings.resolved_database_url))


def cmd_tenant_create(args: argparse.Namespace) -> int:
    from loraplex.storage.repositories import TenantRepository, unit_of_work

    with unit_of_work(_tenant_repo_session(_settings(args))) as session:
        tenant, key = TenantRepository(session).create_tenant(args.name)
        print(f"tenant {tenant.name} ({tenant.id}) created; its API key (shown once):", file=sys.stderr)
    print(key)  # the last line of output is the key, for scripts
    return 0


def cmd_tenant_keys(args: argparse.Namespace) -> int:
    from loraplex.storage.repositories import TenantRepository

    with _tenant_repo_session(_settings(args))() as session:
        repo = TenantRepository(session)
        for key in repo.list_keys(repo.get_by_name(args.name).id):
            state = f"revoked {key.revoked_at:%Y-%m-%d %H:%M}" if key.revoked_at else "active"
            print(f"{key.id}  {key.prefix}...  {key.created_at:%Y-%m-%d %H:%M}  {state}")
    return 0


def cmd_tenant_revoke_key(args: argparse.Namespace) -> int:
    from loraplex.storage.repositories import TenantRepository, unit_of_work

    with unit_of_work(_tenant_repo_session(_settings(args))) as session:
        repo = TenantRepository(session)
        repo.revoke_key(repo.get_by_name(args.name).id, args.key_id)
    print(f"key {args.key_id} of {args.name} revoked (gateways stop accepting it within LORAPLEX_AUTH_CACHE_SECONDS)")
    return 0


def cmd_tenant_rotate_key(args: argparse.Namespace) -> int:
    """A new key for the tenant; every older key is revoked in the same transaction."""
    from loraplex.storage.repositories import TenantRepository, unit_of_work

    with unit_of_work(_tenant_repo_session(_settings(args))) as session:
        repo = TenantRepository(session)
        tenant = repo.get_by_name(args.name)
        old = [k.id for k in repo.list_keys(tenant.id) if k.revoked_at is None]
        key = repo.issue_key(tenant.id)
        for key_id in old:
            repo.revoke_key(tenant.id, key_id)
        print(f"new API key for {tenant.name} (shown once); {len(old)} older key(s) revoked:", file=sys.stderr)
    print(key)  # the last line of output is the key, for scripts
    return 0


def cmd_tenant_list(args: argparse.Namespace) -> int:
    from loraplex.storage.repositories import TenantRepository

    with _tenant_repo_session(_settings(args))() as session:
        for tenant in TenantRepository(session).list():
            print(f"{tenant.id}  {tenant.name}  {tenant.created_at:%Y-%m-%d %H:%M}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Operator-side PEFT export (it reads the database and the blob store directly): the adapter's latest sampler or
    state checkpoint, verified, written as adapter_model.safetensors + adapter_config.json + the base model's
    tokenizer, with base_model_name_or_path = the local base model folder."""
    from loraplex.errors import LoraplexError

    try:
        out = export_adapter(_settings(args), args.model_id, Path(args.out), tenant=args.tenant)
    except LoraplexError as exc:
        print(f"loraplex export: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


def export_adapter(settings: Settings, model_id: str, out: Path, tenant: str | None = None) -> Path:
    """Export `model_id`'s latest saved checkpoint (sampler weights or state, whichever is newer) as a PEFT folder."""
    from loraplex.errors import NotFoundError
    from loraplex.exporting import find_export_checkpoint, write_peft_folder
    from loraplex.storage.repositories import TenantRepository

    with _tenant_repo_session(settings)() as session:
        owner = TenantRepository(session).owner_of_adapter(model_id)
        if tenant is not None and owner.name != tenant:
            raise NotFoundError(f"adapter {model_id!r} not found for tenant {tenant!r}")
        adapter, checkpoint = find_export_checkpoint(session, owner.id, model_id)
    return write_peft_folder(settings, checkpoint, out, base_model=adapter.base_model)


def cmd_serve(args: argparse.Namespace) -> int:
    from loraplex.embedded import Stack

    settings = _settings(args)
    if not args.embedded:
        import uvicorn

        uvicorn.run("loraplex.api.main:app", host=settings.api_host, port=settings.api_port,
                    workers=settings.resolved_api_workers)
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with Stack(settings) as stack:
        print(f"loraplex serving {settings.base_model} on {stack.base_url} (redis {stack.settings.redis_url})")
        print("create a tenant with: loraplex tenant create NAME   (Ctrl-C stops everything)")
        while not stop.wait(1.0):
            stack.check_children()
    return 0


def cmd_worker(_: argparse.Namespace) -> int:
    from loraplex.pool_process import main

    main()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    home = Path(args.home or tempfile.mkdtemp(prefix="loraplex-demo-"))
    try:
        return _demo(args, home, console)
    finally:
        if not args.home:
            shutil.rmtree(home, ignore_errors=True)


def _demo(args: argparse.Namespace, home: Path, console) -> int:
    from loraplex.demo import TASKS, load_tokenizer, print_table, run_demo, write_report
    from loraplex.embedded import Stack
    from loraplex.netutil import free_port
    from loraplex.storage.repositories import TenantRepository, unit_of_work

    settings = get_settings().model_copy(
        update={"home": home, "database_url": "", "redis_url": "", "base_model": args.base_model or "tiny"}
    )
    started = time.monotonic()
    with Stack(settings, api_port=args.port or free_port()) as stack:
        console.print(f"stack up in {time.monotonic() - started:.1f} s at {stack.base_url} (state in {home})")
        sessions = _tenant_repo_session(stack.settings)
        keys = {}
        with unit_of_work(sessions) as session:
            for name in TASKS:
                keys[name] = TenantRepository(session).create_tenant(name)[1]
        tokenizer = load_tokenizer(stack.settings.resolved_model_cache, stack.settings.base_model)
        reports = run_demo(stack.base_url, keys, tokenizer, steps=args.steps, lr=args.lr, rank=args.rank, console=console)
    print_table(reports, console)
    if args.report:
        write_report(reports, Path(args.report))
    failing = [r.name for r in reports if not r.last_loss < 0.5 * r.first_loss]
    console.print(f"done in {time.monotonic() - started:.1f} s")
    if failing:
        console.print(f"[red]loss did not halve for: {', '.join(failing)}[/red]")
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the gateway; --embedded also starts redis, the database and a worker pool")
    p.add_argument("--embedded", action="store_true")
    p.add_argument("--base-model")
    p.add_argument("--port", type=int)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("migrate", help="bring the database to the latest schema")
    p.set_defaults(func=cmd_migrate)

    tenant = sub.add_parser("tenant", help="manage tenants").add_subparsers(dest="tenant_command", required=True)
    p = tenant.add_parser("create", help="create a tenant; prints its API key as the last line")
    p.add_argument("name")
    p.set_defaults(func=cmd_tenant_create)
    p = tenant.add_parser("list", help="list tenants")
    p.set_defaults(func=cmd_tenant_list)
    p = tenant.add_parser("keys", help="a tenant's API keys (id, prefix, created, active or revoked)")
    p.add_argument("name")
    p.set_defaults(func=cmd_tenant_keys)
    p = tenant.add_parser("revoke-key", help="revoke one API key of a tenant (its id from `tenant keys`)")
    p.add_argument("name")
    p.add_argument("key_id")
    p.set_defaults(func=cmd_tenant_revoke_key)
    p = tenant.add_parser("rotate-key", help="issue a new API key (printed last) and revoke the tenant's older keys")
    p.add_argument("name")
    p.set_defaults(func=cmd_tenant_rotate_key)

    p = sub.add_parser(
        "export",
        help="write an adapter's latest saved checkpoint as a PEFT folder (save_weights_for_sampler or save_state "
        "first); reads the database and blob store of LORAPLEX_HOME",
    )
    p.add_argument("model_id")
    p.add_argument("--out", required=True, help="folder to write adapter_model.safetensors + adapter_config.json to")
    p.add_argument("--tenant", help="the adapter's tenant name (default: whichever tenant owns it)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("worker", help="run one worker pool process (dispatcher + rank 0)")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("demo", help="4 tenants train 4 tasks concurrently on the embedded stack")
    p.add_argument("--report", help="write a JSON report here")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--base-model")
    p.add_argument("--port", type=int)
    p.add_argument("--home", help="state folder (default: a new temporary folder)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    from loraplex.errors import LoraplexError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except LoraplexError as exc:  # a user error (unknown tenant, bad key id...): its message, no traceback
        print(f"loraplex: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
