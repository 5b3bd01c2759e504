"""How checkpoints are named and addressed, in one place, free of torch and SQL (the gateway, the client, storage and
the workers all read it):

- the kinds of checkpoint (`CheckpointKind`), each with its Tinker path segment and Tinker listing type;
- the name rule (`validate_checkpoint_name`): one path component, safe in a URL, a blob key and a folder name;
- the `tinker://<model_id>/<weights|sampler_weights>/<name>` codec (`tinker_path`, `parse_tinker_path`), and the
  shorter `<kind>/<name>` references of the REST routes (`parse_kind`, `parse_checkpoint_ref`);
- the blob key of a checkpoint's folder (`checkpoint_blob_key`): `<tenant>/<model>/<kind>/<name>`.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import NamedTuple

from loraplex.errors import InvalidRequestError, NotFoundError


class CheckpointKind(StrEnum):
    """What a checkpoint holds. The values are stored in SQL and in each checkpoint's manifest: never rename them."""

    STATE = "state"  # weights + optimizer state (save_state / save_weights)
    SAMPLER = "sampler"  # weights only, for sampling (save_weights_for_sampler)


# The kinds a worker writes (a checkpoint's manifest names one) and a tinker path can address.
SAVED_KINDS: tuple[CheckpointKind, ...] = (CheckpointKind.STATE, CheckpointKind.SAMPLER)


def kind_for_save(with_optimizer: bool) -> CheckpointKind:
    """The kind a save writes: the optimizer state makes it a state checkpoint, weights alone a sampler one."""
    return CheckpointKind.STATE if with_optimizer else CheckpointKind.SAMPLER


# Tinker's path segment of each addressable kind, and back.
SEGMENT_BY_KIND: dict[CheckpointKind, str] = {
    CheckpointKind.STATE: "weights",
    CheckpointKind.SAMPLER: "sampler_weights",
}
KIND_BY_SEGMENT: dict[str, CheckpointKind] = {segment: kind for kind, segment in SEGMENT_BY_KIND.items()}
# Tinker's `checkpoint_type` in checkpoint listings.
TYPE_BY_KIND: dict[CheckpointKind, str] = {
    CheckpointKind.STATE: "training",
    CheckpointKind.SAMPLER: "sampler",
}


# The longest time to live a checkpoint may be given (seconds; 100 years): beyond it an expiry date overflows.
MAX_TTL_SECONDS = 100 * 365 * 24 * 3600


# ---- names -------------------------------------------------------------------------------------------------------------
CHECKPOINT_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def validate_checkpoint_name(name: object) -> str:
    """A checkpoint name usable as one path component: 1-128 of [A-Za-z0-9_.-], not "." or ".."."""
    if not isinstance(name, str) or not CHECKPOINT_NAME_PATTERN.fullmatch(name) or name in (".", ".."):
        raise InvalidRequestError(
            f"invalid checkpoint name {name!r}: use 1-128 characters from [A-Za-z0-9_.-], not '.' or '..'"
        )
    return name


# ---- tinker paths ------------------------------------------------------------------------------------------------------
TINKER_SCHEME = "tinker://"


class TinkerPath(NamedTuple):
    model_id: str
    kind: CheckpointKind
    name: str

    def __str__(self) -> str:
        return tinker_path(self.model_id, self.kind, self.name)


def tinker_path(model_id: str, kind: CheckpointKind, name: str) -> str:
    """`tinker://<model_id>/<weights|sampler_weights>/<name>` (KeyError for a kind no path reaches)."""
    return f"{TINKER_SCHEME}{model_id}/{SEGMENT_BY_KIND[CheckpointKind(kind)]}/{name}"


def split_tinker_path(path: str) -> tuple[str, str, str]:
    """`tinker://<model_id>/<segment>/<name>` -> its three parts, the segment unchecked (InvalidRequestError when the
    shape is wrong). The client sends the parts on as they are; the server reads the kind from them."""
    if not isinstance(path, str) or not path.startswith(TINKER_SCHEME):
        raise InvalidRequestError(f"not a checkpoint path: {path!r} (expected tinker://<model_id>/weights/<name>)")
    parts = path[len(TINKER_SCHEME) :].split("/")
    if len(parts) != 3 or not all(parts):
        raise _not_a_path(path)
    return parts[0], parts[1], parts[2]


def parse_tinker_path(path: str) -> TinkerPath:
    """`tinker://<model_id>/<weights|sampler_weights>/<name>` -> its parts (InvalidRequestError when malformed)."""
    model_id, segment, name = split_tinker_path(path)
    if segment not in KIND_BY_SEGMENT:
        raise _not_a_path(path)
    return TinkerPath(model_id, KIND_BY_SEGMENT[segment], name)


def _not_a_path(path: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"not a checkpoint path: {path!r} (expected tinker://<model_id>/<weights|sampler_weights>/<name>)"
    )


def parse_kind(value: str) -> CheckpointKind:
    """A kind as a URL names it: `weights` / `sampler_weights` (Tinker) or `state` / `sampler` (NotFoundError else:
    it is a path segment of a REST route)."""
    if value in KIND_BY_SEGMENT:
        return KIND_BY_SEGMENT[value]
    if value in SAVED_KINDS:
        return CheckpointKind(value)
    raise NotFoundError(f"no checkpoint kind {value!r}: use weights or sampler_weights")


def parse_checkpoint_ref(model_id: str, ref: str) -> tuple[CheckpointKind, str]:
    """`tinker://<model_id>/<weights|sampler_weights>/<name>` (of this adapter) or `<kind>/<name>` (kind: weights,
    sampler_weights, state or sampler) -> (kind, name); InvalidRequestError when it is neither."""
    if ref.startswith(TINKER_SCHEME):
        parsed = parse_tinker_path(ref)
        if parsed.model_id != model_id:
            raise InvalidRequestError(f"{ref} is a checkpoint of adapter {parsed.model_id!r}, not of {model_id!r}")
        return parsed.kind, parsed.name
    segment, sep, name = ref.partition("/")
    if not sep or not name or "/" in name:
        raise InvalidRequestError(
            f"not a checkpoint reference: {ref!r} (expected tinker://{model_id}/<weights|sampler_weights>/<name> "
            "or <weights|sampler_weights>/<name>)"
        )
    try:
        return parse_kind(segment), name
    except NotFoundError as exc:
        raise InvalidRequestError(exc.message) from None


# ---- blob keys ---------------------------------------------------------------------------------------------------------
def checkpoint_blob_key(tenant_id: str, model_id: str, kind: CheckpointKind, name: str) -> str:
    """The blob key of a checkpoint's folder. Tinker model ids hold ':' (not a blob key character): it becomes '_'
    (native ids are hex, so no two adapters of a tenant map to one key)."""
    return f"{tenant_id}/{model_id.replace(':', '_')}/{CheckpointKind(kind).value}/{name}"
