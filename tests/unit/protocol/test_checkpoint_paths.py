"""Checkpoint addressing (loraplex.protocol.checkpoint_paths): the name rule, the tinker path codec and its rejections, the REST
references, the blob key, the one vocabulary of kinds, and that the gateway and client load neither torch nor workers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.protocol import checkpoint_paths as paths
from loraplex.protocol.checkpoint_paths import CheckpointKind, TinkerPath
from loraplex.storage import enums


@pytest.mark.parametrize("name", ["a", "step-10", "final.v2", "A_b-c.d", "x" * 128, "..."])
def test_valid_names_pass_unchanged(name: str) -> None:
    assert paths.validate_checkpoint_name(name) == name


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x", "with space", "x" * 129, "ü", "a\n", None, 7])
def test_bad_names_are_invalid_requests_naming_the_rule(name: object) -> None:
    with pytest.raises(InvalidRequestError, match=r"invalid checkpoint name .*\[A-Za-z0-9_\.-\]"):
        paths.validate_checkpoint_name(name)


def test_workers_reexport_the_same_name_rule() -> None:
    from loraplex.workers.state.checkpoint import validate_checkpoint_name

    assert validate_checkpoint_name is paths.validate_checkpoint_name


@pytest.mark.parametrize("kind", paths.SAVED_KINDS)
@pytest.mark.parametrize("model_id", ["0123abcd" * 4, "sess-1:train:0"])
def test_tinker_paths_round_trip(model_id: str, kind: CheckpointKind) -> None:
    path = paths.tinker_path(model_id, kind, "step-3")
    assert path == f"tinker://{model_id}/{paths.SEGMENT_BY_KIND[kind]}/step-3"
    parsed = paths.parse_tinker_path(path)
    assert parsed == TinkerPath(model_id, kind, "step-3") and str(parsed) == path
    assert paths.split_tinker_path(path) == (model_id, paths.SEGMENT_BY_KIND[kind], "step-3")


def test_tinker_segments_are_tinkers_names() -> None:
    assert paths.tinker_path("m", CheckpointKind.STATE, "n") == "tinker://m/weights/n"
    assert paths.tinker_path("m", "sampler", "n") == "tinker://m/sampler_weights/n"  # a plain value works too
    with pytest.raises(ValueError):
        paths.tinker_path("m", "export", "n")  # no such kind


@pytest.mark.parametrize("bad", ["weights/final", "file:///etc", "", "TINKER://m/weights/n"])
def test_a_path_without_the_scheme_is_rejected(bad: str) -> None:
    for parse in (paths.parse_tinker_path, paths.split_tinker_path):
        with pytest.raises(InvalidRequestError, match=r"not a checkpoint path: .*expected tinker://<model_id>/weights"):
            parse(bad)


@pytest.mark.parametrize(
    "bad", ["tinker://x/weights", "tinker://x/weights/a/b", "tinker:///weights/n", "tinker://x//n"]
)
def test_a_path_of_the_wrong_shape_is_rejected(bad: str) -> None:
    for parse in (paths.parse_tinker_path, paths.split_tinker_path):
        with pytest.raises(
            InvalidRequestError, match=r"expected tinker://<model_id>/<weights\|sampler_weights>/<name>"
        ):
            parse(bad)


def test_an_unknown_segment_is_rejected_by_the_parser_only() -> None:
    with pytest.raises(InvalidRequestError, match="not a checkpoint path"):
        paths.parse_tinker_path("tinker://x/other/n")
    with pytest.raises(InvalidRequestError):
        paths.parse_tinker_path("tinker://x/state/n")  # a stored kind is not a tinker segment
    # The client splits only: the server decides what the segment means.
    assert paths.split_tinker_path("tinker://x/state/n") == ("x", "state", "n")
    with pytest.raises(InvalidRequestError):
        paths.parse_tinker_path(None)  # type: ignore[arg-type]


def test_url_kinds_accept_tinker_segments_and_stored_kinds() -> None:
    assert paths.parse_kind("weights") is CheckpointKind.STATE
    assert paths.parse_kind("sampler_weights") is CheckpointKind.SAMPLER
    assert paths.parse_kind("state") is CheckpointKind.STATE
    assert paths.parse_kind("sampler") is CheckpointKind.SAMPLER
    for bad in ("export", "other", ""):
        with pytest.raises(NotFoundError, match="use weights or sampler_weights"):
            paths.parse_kind(bad)


def test_checkpoint_refs_are_a_path_of_this_adapter_or_kind_and_name() -> None:
    assert paths.parse_checkpoint_ref("m", "tinker://m/sampler_weights/s") == (CheckpointKind.SAMPLER, "s")
    assert paths.parse_checkpoint_ref("m", "weights/final") == (CheckpointKind.STATE, "final")
    assert paths.parse_checkpoint_ref("m", "sampler/s") == (CheckpointKind.SAMPLER, "s")
    with pytest.raises(InvalidRequestError, match="is a checkpoint of adapter 'other'"):
        paths.parse_checkpoint_ref("m", "tinker://other/weights/x")
    for bad in ("final", "weights/", "weights/a/b", "other/x"):
        with pytest.raises(InvalidRequestError):
            paths.parse_checkpoint_ref("m", bad)


def test_blob_keys_name_the_tenant_adapter_kind_and_name() -> None:
    assert paths.checkpoint_blob_key("t1", "abc", CheckpointKind.STATE, "final") == "t1/abc/state/final"
    assert paths.checkpoint_blob_key("t1", "s:train:0", "sampler", "n") == "t1/s_train_0/sampler/n"


def test_one_vocabulary_of_kinds() -> None:
    assert enums.CheckpointKind is CheckpointKind  # what storage persists is this enum
    assert [k.value for k in CheckpointKind] == ["state", "sampler"]  # stored values: never renamed
    assert paths.SAVED_KINDS == tuple(paths.SEGMENT_BY_KIND) == (CheckpointKind.STATE, CheckpointKind.SAMPLER)
    assert {paths.KIND_BY_SEGMENT[s]: s for s in paths.KIND_BY_SEGMENT} == paths.SEGMENT_BY_KIND
    assert set(paths.TYPE_BY_KIND) == set(CheckpointKind)
    assert paths.kind_for_save(with_optimizer=True) is CheckpointKind.STATE
    assert paths.kind_for_save(with_optimizer=False) is CheckpointKind.SAMPLER


def test_the_gateway_and_the_client_load_neither_torch_nor_workers() -> None:
    code = (
        "import sys\n"
        "import loraplex.api.app, loraplex.client, loraplex.protocol.checkpoint_paths\n"
        "loaded = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'loraplex.workers'))]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
