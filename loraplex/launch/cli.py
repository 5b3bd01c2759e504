"""The `loraplex` command: serve the stack, manage tenants, move adapters between pools, export adapters, run the
demo."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from pydantic import ValidationError

from loraplex.runtime.stop_signals import stop_on_signals
from loraplex.settings import Settings, get_settings


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {}
    base_model = getattr(args, "base_model", None)
    if base_model:  # serve's repeated flag gives a list: its first model is the gateway's own
        overrides["base_model"] = base_model[0] if isinstance(base_model, list) else base_model
    if getattr(args, "port", None):
        overrides["api_port"] = args.port
    return get_settings().model_copy(update=overrides)


def cmd_migrate(args: argparse.Namespace) -> int:
    from sqlalchemy.engine import make_url

    from loraplex.storage.db import migrate

    settings = _settings(args)
    settings.home.mkdir(parents=True, exist_ok=True)
    migrate(settings.resolved_database_url)
    shown = make_url(settings.resolved_database_url).render_as_string(hide_password=True)  # never the password
    print(f"database at head: {shown}")
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


def cmd_tenant_delete(args: argparse.Namespace) -> int:
    """Offboard a tenant: refuse while it has live adapters unless --force; else revoke its keys, delete each live
    adapter through the queue (a delete_adapter request, as the gateway's DELETE does, so the pool frees its slot and
    host memory), wait for the pool to answer them, then remove the tenant (its rows cascade: keys, adapters,
    checkpoints, sessions, usage) and its checkpoint files. Safe to run again after a timeout."""
    from loraplex.errors import ConflictError, InvalidRequestError, ServiceUnavailableError
    from loraplex.storage.blobs import BlobStore
    from loraplex.storage.repositories import AdapterRepository, TenantRepository, unit_of_work

    settings = _settings(args)
    sessions = _tenant_repo_session(settings)
    with sessions() as session:
        tenant = TenantRepository(session).get_by_name(args.name)
        live = [a.model_id for a in AdapterRepository(session, tenant.id).list()]
    if live and not args.force:
        shown = ", ".join(live[:5]) + (", ..." if len(live) > 5 else "")
        raise ConflictError(
            f"tenant {args.name} has {len(live)} live adapter(s) ({shown}): delete them first, or pass --force to "
            "revoke its keys and delete them through the queue"
        )
    if live and not settings.redis_url:
        raise InvalidRequestError(
            "LORAPLEX_REDIS_URL is not set: deleting adapters goes through the pool's queue; point it at the "
            "Redis the gateway uses"
        )
    services = None
    if live:
        import redis

        from loraplex.service.build import build_services

        services = build_services(settings)
        try:
            services.redis.ping()  # before anything changes: an adapter marked deleted must get its request queued
        except redis.RedisError as exc:
            services.redis.close()
            raise ServiceUnavailableError(f"redis unavailable ({exc}); nothing changed") from exc
    with unit_of_work(sessions) as session:
        revoked = TenantRepository(session).revoke_all_keys(tenant.id)
    print(f"{revoked} key(s) of {args.name} revoked", file=sys.stderr)
    if services is not None:
        try:
            pending = _delete_adapters_through_the_queue(services, tenant.id, tenant.name, live, args.wait)
        except redis.RedisError as exc:
            raise ServiceUnavailableError(f"redis unavailable ({exc}); the keys are revoked: run it again") from exc
        if pending:
            print(f"loraplex: pool {settings.pool} did not answer {len(pending)} adapter delete(s) within "
                  f"{args.wait:g} s (is `loraplex worker` running?); the keys stay revoked and the deletes queued: "
                  "run this command again", file=sys.stderr)  # fmt: skip
            return 1
    with unit_of_work(sessions) as session:
        TenantRepository(session).delete(tenant.id)
    BlobStore(settings.resolved_blob_root).delete_tree(tenant.id)
    print(f"tenant {args.name} ({tenant.id}) deleted, with {len(live)} adapter(s)")
    return 0


def _delete_adapters_through_the_queue(services, tenant_id: str, tenant_name: str, live: list[str], wait_s: float):
    """Queue a delete_adapter for each adapter (the gateway's own rule: row marked deleted, request queued), wait up
    to `wait_s` for the pool's answers; returns the adapters whose delete was not answered."""
    from loraplex.service import TenantRef, delete_adapter

    try:
        ref = TenantRef(tenant_id, tenant_name)
        requests = {delete_adapter(services, ref, m).request_id: m for m in live}
        print(f"{len(requests)} adapter delete(s) queued", file=sys.stderr)
        deadline = time.monotonic() + wait_s
        pending = []
        for request_id, model_id in requests.items():
            outcome = services.results.wait(request_id, max(0.0, deadline - time.monotonic()))
            if outcome is None:
                pending.append(model_id)
            elif not outcome.ok:
                print(f"adapter {model_id}: {outcome.error_name}: {outcome.error}", file=sys.stderr)
        return pending
    finally:
        services.redis.close()


def cmd_tenant_list(args: argparse.Namespace) -> int:
    from loraplex.storage.repositories import TenantRepository

    with _tenant_repo_session(_settings(args))() as session:
        for tenant in TenantRepository(session).list():
            print(f"{tenant.id}  {tenant.name}  {tenant.created_at:%Y-%m-%d %H:%M}")
    return 0


def cmd_tenant_weight(args: argparse.Namespace) -> int:
    """Show or set a tenant's fair-share weight (dispatch/fair_share.py)."""
    from loraplex.storage.repositories import TenantRepository, unit_of_work

    with unit_of_work(_tenant_repo_session(_settings(args))) as session:
        repo = TenantRepository(session)
        tenant = repo.get_by_name(args.name)
        if args.weight is not None:
            repo.set_weight(tenant.id, args.weight)
        print(f"{tenant.name} weight {tenant.weight:g}" + (
            " (pools read it within LORAPLEX_TENANT_WEIGHT_CACHE_SECONDS)" if args.weight is not None else ""))  # fmt: skip
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
    from loraplex.service.peft_export import find_export_checkpoint, write_peft_folder
    from loraplex.storage.repositories import TenantRepository

    with _tenant_repo_session(settings)() as session:
        owner = TenantRepository(session).owner_of_adapter(model_id)
        if tenant is not None and owner.name != tenant:
            raise NotFoundError(f"adapter {model_id!r} not found for tenant {tenant!r}")
        adapter, checkpoint = find_export_checkpoint(session, owner.id, model_id)
    return write_peft_folder(settings, checkpoint, out, base_model=adapter.base_model)


def cmd_serve(args: argparse.Namespace) -> int:
    from loraplex.launch.embedded import Stack
    from loraplex.runtime.redis_home import port_is_free

    settings = _settings(args)
    if not args.embedded and len(args.base_model or []) > 1:
        print("loraplex serve: several --base-model need --embedded (a gateway alone serves what the running pools "
              "registered; --base-model names its own pool's model)", file=sys.stderr)  # fmt: skip
        return 2
    if not args.embedded and not settings.redis_url:
        print("loraplex serve: LORAPLEX_REDIS_URL is not set: a gateway alone needs the Redis of its pools "
              "(`loraplex worker`); `loraplex serve --embedded` runs everything here", file=sys.stderr)  # fmt: skip
        return 2
    if not port_is_free(settings.api_port, settings.api_host):
        print(f"loraplex serve: port {settings.api_port} on {settings.api_host} is in use (another loraplex serve?): "
              "stop what listens there, or pass --port (LORAPLEX_API_PORT)", file=sys.stderr)  # fmt: skip
        return 2
    if not args.embedded:
        import uvicorn

        from loraplex.launch.embedded import gateway_metrics_env

        workers = settings.resolved_api_workers
        os.environ.update(gateway_metrics_env(settings, settings.api_port, workers))  # before the workers start
        uvicorn.run("loraplex.launch.gateway:app", host=settings.api_host, port=settings.api_port, workers=workers)
        return 0
    stop = threading.Event()
    stop_on_signals(stop)
    stack = Stack(settings, pool_models=args.base_model or (), pipeline_worker=settings.embedded_pipeline_worker)
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as exc:  # a child that could not start: what it said, in one line
        print(f"loraplex serve: {one_line(exc)}", file=sys.stderr)
        return 1
    try:
        print(serve_banner(stack))
        while not stop.wait(1.0):
            stack.check_children()
    except RuntimeError as exc:  # a child died with supervision off
        print(f"loraplex serve: {one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
    return 0


def serve_banner(stack) -> str:
    """What `serve --embedded` prints once everything answers: what it serves, where, and the next commands."""
    served = ", ".join(f"{env['LORAPLEX_BASE_MODEL']} (pool {env['LORAPLEX_POOL']})" for env in stack.pools.values())
    if stack.pipeline_worker:
        pipelines = (f"a worker running up to {stack.settings.pipeline_worker_concurrency} at once "
                     f"(log {stack.log_dir / 'pipelines.log'})")  # fmt: skip
    else:
        pipelines = "no worker (LORAPLEX_EMBEDDED_PIPELINE_WORKER=false): start one with `loraplex pipelines worker`"
    return "\n".join([
        f"loraplex serving {served} on {stack.base_url} (redis {stack.settings.redis_url})",
        f"pipelines: {pipelines}",
        f"web admin: {stack.base_url}/admin   (make a login first: loraplex admin create NAME)",
        "create a tenant with: loraplex tenant create NAME   (Ctrl-C stops everything)",
    ])  # fmt: skip


def one_line(exc: BaseException) -> str:
    """An error's message on one line (a child's log tail can span several), at most 500 characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 500 else text[:497] + "..."


def cmd_worker(_: argparse.Namespace) -> int:
    """The pool process; with `supervise` (the default) as a child of this one, restarted whenever it dies (a crash,
    a SIGKILL, a lost lease: it then waits as a standby), until this process gets SIGTERM / SIGINT. The preflight
    (Redis URL set, database migrated) runs here first, so a missing setting exits at once instead of restarting."""
    settings = get_settings()
    # Unsupervised: asked for; under torchrun (torchrun supervises); or a standby that must exit instead of waiting.
    if not settings.supervise or os.environ.get("RANK") is not None or not settings.leader_wait:
        from loraplex.pool.process import main

        main()
        return 0
    from loraplex.pool.process import preflight
    from loraplex.runtime.supervisor import Child, Supervisor

    preflight(settings)  # what no restart can fix (no Redis URL) exits here, naming it

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    stop_on_signals(stop)
    env = dict(os.environ) | {"LORAPLEX_SUPERVISE": "false", "PYTHONUNBUFFERED": "1"}
    pool = Child("pool", [sys.executable, "-m", "loraplex.pool.process"], env)
    pool.start()
    supervisor = Supervisor([pool], backoff_s=settings.restart_backoff_seconds).start()
    try:
        stop.wait()
    finally:
        supervisor.stop()
        pool.stop(grace_s=60.0)  # SIGTERM: the pool finishes its plan and writes its snapshots
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
    from loraplex.admin.passwords import hash_password
    from loraplex.launch.demo import TASKS, load_tokenizer, print_table, run_demo, write_report
    from loraplex.launch.embedded import Stack
    from loraplex.runtime.netutil import free_port
    from loraplex.storage.repositories import AdminRepository, TenantRepository, unit_of_work

    settings = get_settings().model_copy(
        update={"home": home, "database_url": "", "redis_url": "", "base_model": args.base_model or "tiny"}
    )
    started = time.monotonic()
    with Stack(settings, api_port=args.port or free_port()) as stack:
        console.print(f"stack up in {time.monotonic() - started:.1f} s at {stack.base_url} (state in {home})")
        sessions = _tenant_repo_session(stack.settings)
        keys = {}
        password = secrets.token_urlsafe(12)  # the demo's stack is thrown away at the end; so is this account
        with unit_of_work(sessions) as session:
            for name in TASKS:
                keys[name] = TenantRepository(session).create_tenant(name)[1]
            AdminRepository(session).create("demo", hash_password(password))
        console.print(f"watch it live: {stack.base_url}/admin/dashboard (user demo, password {password})")
        tokenizer = load_tokenizer(stack.settings.resolved_model_cache, stack.settings.base_model)
        reports = run_demo(
            stack.base_url, keys, tokenizer, steps=args.steps, lr=args.lr, rank=args.rank, console=console
        )
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

    p = sub.add_parser(
        "serve",
        help="run the gateway; --embedded also starts redis, the database, a worker pool and a pipelines worker",
        description="Run the gateway (HTTP API, Tinker routes, OpenAI endpoint, web admin at /admin). Alone it serves "
        "the pools that run elsewhere (`loraplex worker`) against LORAPLEX_REDIS_URL and LORAPLEX_DATABASE_URL. "
        "Every other setting is a LORAPLEX_* environment variable (loraplex/settings.py).",
    )
    p.add_argument("--embedded", action="store_true",
                   help="run everything on this machine as supervised children (restarted when they die): a "
                        "redis-server (unless LORAPLEX_REDIS_URL is set; its port is kept in LORAPLEX_HOME/redis), "
                        "the SQLite database under LORAPLEX_HOME (unless LORAPLEX_DATABASE_URL), one worker pool per "
                        "--base-model, the gateway, and a pipelines worker (LORAPLEX_EMBEDDED_PIPELINE_WORKER=false: "
                        "none); logs in LORAPLEX_HOME/logs")  # fmt: skip
    p.add_argument("--base-model", action="append",
                   help="the base model to serve (default LORAPLEX_BASE_MODEL, else tiny): a preset name or a local "
                        "Hugging Face folder; repeated with --embedded: one pool process per flag, in order "
                        "(e.g. --base-model tiny --base-model tiny --base-model tiny-moe: two pools of tiny, one of "
                        "tiny-moe)")  # fmt: skip
    p.add_argument("--port", type=int,
                   help="the gateway's port (default LORAPLEX_API_PORT, else 8700; the address is LORAPLEX_API_HOST, "
                        "else 127.0.0.1)")  # fmt: skip
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("migrate", help="bring the database to the latest schema")
    p.set_defaults(func=cmd_migrate)

    tenant = sub.add_parser("tenant", help="manage tenants").add_subparsers(dest="tenant_command", required=True)
    p = tenant.add_parser("create", help="create a tenant; prints its API key as the last line")
    p.add_argument("name")
    p.set_defaults(func=cmd_tenant_create)
    p = tenant.add_parser("list", help="list tenants")
    p.set_defaults(func=cmd_tenant_list)
    p = tenant.add_parser("weight", help="show or set a tenant's fair-share weight (default 1; 2 = twice the "
                          "training tokens of a weight-1 tenant when both are backlogged)")  # fmt: skip
    p.add_argument("name")
    p.add_argument("weight", type=float, nargs="?", help="the new weight (> 0); omitted: show it")
    p.set_defaults(func=cmd_tenant_weight)
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
    p = tenant.add_parser(
        "delete",
        help="delete a tenant: refused while it has live adapters unless --force, which revokes its keys, deletes "
        "each adapter through the queue (the pool must be running) and waits for the pool; then the tenant, its rows "
        "(keys, adapters, checkpoints, sessions, usage) and its checkpoint files are removed",
    )
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="delete its live adapters too (through the queue)")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the pool's answers (default 120)")
    p.set_defaults(func=cmd_tenant_delete)

    p = sub.add_parser(
        "export",
        help="write an adapter's latest saved checkpoint as a PEFT folder (save_weights_for_sampler or save_state "
        "first); reads the database and blob store of LORAPLEX_HOME",
    )
    p.add_argument("model_id")
    p.add_argument("--out", required=True, help="folder to write adapter_model.safetensors + adapter_config.json to")
    p.add_argument("--tenant", help="the adapter's tenant name (default: whichever tenant owns it)")
    p.set_defaults(func=cmd_export)

    from loraplex.launch.cli_pipelines import add_parsers as add_pipeline_parsers

    add_pipeline_parsers(sub)

    from loraplex.launch.cli_pools import add_parsers as add_pool_parsers

    add_pool_parsers(sub)

    p = sub.add_parser("worker", help="run one worker pool process (dispatcher + rank 0)")
    p.set_defaults(func=cmd_worker)

    from loraplex.admin.cli import register as register_admin

    register_admin(sub)

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


def invalid_settings_line(exc: ValidationError) -> str:
    """Settings that did not validate, as one line naming each environment variable, its value and what is wrong."""
    parts = []
    for error in exc.errors():
        name = f"LORAPLEX_{str(error['loc'][0]).upper()}" if error.get("loc") else "a setting"
        parts.append(f"{name}={error.get('input')!r}: {error['msg']}")
    return "invalid setting " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    from loraplex.errors import LoraplexError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except LoraplexError as exc:  # a user error (unknown tenant, bad key id...): its message, no traceback
        print(f"loraplex: {exc.message}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        if exc.title != "Settings":
            raise
        print(f"loraplex: {invalid_settings_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:
        line = store_outage_line(exc)
        if line is None:
            raise
        print(f"loraplex: {line}", file=sys.stderr)
        return 1


def store_outage_line(exc: BaseException) -> str | None:
    """One line for a store the command needs being down or busy (Redis refused or timed out; the database locked
    past its busy timeout by another process, or unreachable); None for anything else, a bug that keeps its
    traceback. A write interrupted this way rolled back: running the command again is safe."""
    import redis
    from sqlalchemy.exc import OperationalError

    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        part = "redis"
    elif isinstance(exc, OperationalError):
        part = "the database"
    else:
        return None
    first = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return f"{part} is unavailable ({first}); the command stopped there (its open write rolled back): run it again"


if __name__ == "__main__":
    sys.exit(main())
