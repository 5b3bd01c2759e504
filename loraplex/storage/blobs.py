"""Where checkpoint files live on a local (or shared) filesystem, addressed by relative keys like
"tenant/model/state/step-10": the gateway maps a key to its folder (`path`) and URI, the retention job deletes them.
The workers write the folders themselves, atomically (`fsutil.write_folder_atomic`, owner-only). Keys are checked so no
key can reach outside the root, and the root is owner-only (0700)."""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path
from urllib.parse import unquote, urlparse

from loraplex.errors import InvalidRequestError
from loraplex.runtime.fsutil import PRIVATE_DIR_MODE, private_dirs

_KEY_CHARS = re.compile(r"^[A-Za-z0-9_.\-/]+$")


class BlobStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = private_dirs(Path(root).resolve())
        # Owner-only: the store holds every tenant's weights (a root made before this rule is tightened once).
        info = self.root.stat()
        if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) != PRIVATE_DIR_MODE:
            os.chmod(self.root, PRIVATE_DIR_MODE)

    def path(self, key: str) -> Path:
        """The file a valid key maps to (it may not exist yet)."""
        _check_key(key)
        path = (self.root / key).resolve()
        # Catches symlinks inside the root that point out of it.
        if not path.is_relative_to(self.root):
            raise InvalidRequestError(f"blob key {key!r} escapes the store")
        return path

    def uri(self, key: str) -> str:
        return self.path(key).as_uri()

    def key_for_uri(self, uri: str) -> str:
        """Inverse of `uri`: the key of a file:// URI inside this store."""
        parsed = urlparse(uri)
        if parsed.scheme != "file":
            raise InvalidRequestError(f"not a file:// blob URI: {uri!r}")
        path = Path(unquote(parsed.path))
        if not path.is_relative_to(self.root):
            raise InvalidRequestError(f"blob URI {uri!r} is outside the store")
        key = path.relative_to(self.root).as_posix()
        self.path(key)
        return key

    def delete(self, key: str) -> bool:
        """Remove the blob; returns False when it was already gone (deletes are retried by cleanup jobs)."""
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            return False
        return True


    def delete_tree(self, prefix: str) -> bool:
        """Remove the folder `prefix` (e.g. a tenant's id: all its checkpoint folders); False when it was not there."""
        _check_key(prefix)
        path = self.path(prefix)
        if not path.is_dir():
            return False
        shutil.rmtree(path)
        return True


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key or not _KEY_CHARS.fullmatch(key):
        raise InvalidRequestError(f"invalid blob key {key!r}: use A-Z a-z 0-9 _ . - /")
    if key.startswith("/") or key.endswith("/"):
        raise InvalidRequestError(f"invalid blob key {key!r}: must be relative and name a file")
    # Empty, "." and ".." segments could escape or alias; names starting with "." are reserved for temp files.
    if any(not part or part.startswith(".") for part in key.split("/")):
        raise InvalidRequestError(f"invalid blob key {key!r}: no empty, '.', '..' or hidden segments")
