"""Admin passwords as salted scrypt hashes (the standard library's hashlib.scrypt; no plaintext is ever stored).

Format: "scrypt$<n>$<r>$<p>$<salt, base64>$<hash, base64>", so the cost can be raised later without breaking the
hashes already stored (verify reads the parameters from the hash)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os

N, R, P = 2**14, 8, 1  # ~16 MiB and ~30 ms per hash on these machines: slows guessing, fine for a login
MIN_LENGTH = 12


def hash_password(password: str) -> str:
    salt = os.urandom(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=N, r=R, p=P, dklen=32)
    return "$".join(
        ["scrypt", str(N), str(R), str(P), base64.b64encode(salt).decode(), base64.b64encode(digest).decode()]
    )


def verify_password(password: str, stored: str) -> bool:
    """Whether `password` matches the stored hash (constant-time compare; a malformed hash never matches)."""
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        expected = base64.b64decode(digest)
        got = hashlib.scrypt(
            password.encode(), salt=base64.b64decode(salt), n=int(n), r=int(r), p=int(p), dklen=len(expected)
        )
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, expected)


def check_new_password(password: str) -> None:
    """ValueError unless the password is long enough to be worth hashing."""
    if len(password) < MIN_LENGTH:
        raise ValueError(f"an admin password needs at least {MIN_LENGTH} characters")
