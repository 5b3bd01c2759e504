"""`loraplex admin ...`: the web admin's accounts (create, list, unlock, passwd). The password comes from a prompt, or
one line on stdin with --password-stdin (for scripts); it is hashed here and never stored or printed in clear."""

from __future__ import annotations

import argparse
import getpass
import sys
from collections.abc import Callable
from typing import Any

from loraplex.errors import InvalidRequestError


def _sessions() -> Any:
    from loraplex.settings import get_settings
    from loraplex.storage.db import make_db_engine, migrate, session_factory

    settings = get_settings()
    settings.home.mkdir(parents=True, exist_ok=True)
    migrate(settings.resolved_database_url)
    return session_factory(make_db_engine(settings.resolved_database_url))


def _password(args: argparse.Namespace) -> str:
    from loraplex.admin.passwords import check_new_password

    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\n")
    else:
        password = getpass.getpass("password: ")
        if getpass.getpass("again: ") != password:
            raise InvalidRequestError("the passwords differ")
    try:
        check_new_password(password)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    return password


def _with_new_password(args: argparse.Namespace, change: Callable[[Any, str], object], done: str) -> int:
    """Hash a new password (prompted or from stdin), apply `change(repository, hash)` in one transaction."""
    from loraplex.admin.passwords import hash_password
    from loraplex.storage.repositories import AdminRepository, unit_of_work

    hashed = hash_password(_password(args))
    with unit_of_work(_sessions()) as db:
        change(AdminRepository(db), hashed)
    print(done, file=sys.stderr)
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    return _with_new_password(args, lambda repo, hashed: repo.create(args.username, hashed),
                              f"admin {args.username} created; log in at /admin")  # fmt: skip


def cmd_passwd(args: argparse.Namespace) -> int:
    return _with_new_password(args, lambda repo, hashed: repo.set_password(args.username, hashed),
                              f"password of {args.username} changed; its earlier sessions are over")  # fmt: skip


def cmd_unlock(args: argparse.Namespace) -> int:
    from loraplex.storage.repositories import AdminRepository, unit_of_work

    with unit_of_work(_sessions()) as db:
        AdminRepository(db).unlock(args.username)
    print(f"admin {args.username} unlocked", file=sys.stderr)
    return 0


def cmd_list(_: argparse.Namespace) -> int:
    from loraplex.storage.repositories import AdminRepository

    with _sessions()() as db:
        repo = AdminRepository(db)
        for account in repo.list():
            state = f"locked until {account.locked_until:%Y-%m-%d %H:%M}" if repo.locked(account) else "active"
            last = f"{account.last_login_at:%Y-%m-%d %H:%M}" if account.last_login_at else "never"
            print(f"{account.username}\t{state}\tlast login {last}")
    return 0


def register(sub: Any) -> None:
    admin = sub.add_parser("admin", help="web admin accounts (/admin)").add_subparsers(dest="admin_command",
                                                                                      required=True)  # fmt: skip
    for name, func, text in (
        ("create", cmd_create, "create an admin account (password from a prompt or --password-stdin)"),
        ("passwd", cmd_passwd, "set an admin's password (ends its sessions)"),
        ("unlock", cmd_unlock, "lift the lockout after repeated failed logins"),
    ):
        p = admin.add_parser(name, help=text)
        p.add_argument("username")
        if func is not cmd_unlock:
            p.add_argument("--password-stdin", action="store_true", help="read the password as one line on stdin")
        p.set_defaults(func=func)
    admin.add_parser("list", help="admin accounts, whether locked, last login").set_defaults(func=cmd_list)
