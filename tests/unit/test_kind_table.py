"""Every per-kind fact lives in protocol/kinds.py's table, and a request kind is built from it alone.

- No module outside loraplex/protocol/ holds a set, tuple or list of two or more RequestKind / StepKind members (the
  form every scattered per-kind fact took: the replayed kinds, the resident steps, the quota exemption, the usage
  kinds), and the layers that branch on those facts read the table's fields by name.
- A kind declared here, with its payload dataclass and a row, decodes from its JSON form through the one generic
  decoder and counts its tokens through its row: no decoder, token count or set elsewhere to write.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import pytest

from loraplex.protocol import KINDS, KindSpec, Payload, RequestKind
from loraplex.protocol.wire import from_json
from loraplex.queue.envelope import encode_payload

ROOT = Path(__file__).resolve().parents[2] / "loraplex"
ENUMS = ("RequestKind", "StepKind")

# Who branches on which fact of the row (the module, and the KindSpec field it must read).
READERS = {
    "dispatch/loop.py": "changes_state",  # which answered requests the request log replays
    "pool/durable/snapshotter.py": "changes_state",  # which make an adapter due for a snapshot
    "workers/engine/executor.py": "needs_residency",  # which steps swap their adapters into slots
    "queue/producer.py": "quota_exempt",  # which skip the tenant's queue quotas
    "pool/records.py": "counts_usage",  # which are billed as usage
}


def _member(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ENUMS


def _kind_groups(tree: ast.AST) -> list[str]:
    """Literals of two or more kind members; a tuple unpacked into named locals (`create, delete = StepKind.CREATE,
    StepKind.DELETE`, a hot loop's idiom) is no group."""
    unpacked = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Tuple)}
    return [
        f"line {node.lineno}: {ast.unparse(node)[:100]}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Set | ast.Tuple | ast.List)
        and id(node) not in unpacked
        and sum(_member(e) for e in node.elts) >= 2
    ]


def test_no_module_outside_protocol_keeps_a_group_of_kinds() -> None:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).parts[0] == "protocol":
            continue
        groups = _kind_groups(ast.parse(path.read_text(), str(path)))
        if groups:
            found[str(path.relative_to(ROOT))] = groups
    assert found == {}, f"per-kind facts belong in protocol/kinds.py's KindSpec: {found}"


@pytest.mark.parametrize(("module", "fact"), sorted(READERS.items()))
def test_the_layers_read_their_facts_from_the_table(module: str, fact: str) -> None:
    assert fact in {f.name for f in KindSpec.__dataclass_fields__.values()}
    names = {n.attr for n in ast.walk(ast.parse((ROOT / module).read_text())) if isinstance(n, ast.Attribute)}
    assert fact in names, f"{module} should read KindSpec.{fact} from protocol.KINDS"


def test_the_sets_of_kinds_are_gone_from_the_layers() -> None:
    for module, name in (("dispatch/loop.py", "STATE_KINDS"), ("workers/engine/executor.py", "RESIDENT_STEPS")):
        tree = ast.parse((ROOT / module).read_text())
        literals = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
                    and _kind_groups(n.value)]  # fmt: skip
        assert literals == [], f"{module}: {name} as a literal set of kinds"


@dataclass(frozen=True)
class EchoItem(Payload):
    KIND_NAME: ClassVar[str] = "echo_item"
    tokens: list[int]
    label: str | None = None


@dataclass(frozen=True)
class EchoPayload(Payload):
    """A payload a new kind might take: nested items, a tuple, a float, a free mapping."""

    KIND_NAME: ClassVar[str] = "echo"
    items: tuple[EchoItem, ...] = ()
    scale: float = 1.0
    options: dict[str, object] = field(default_factory=dict)

    def count(self, part: tuple[int, int] | None = None) -> int:
        return sum(len(i.tokens) for i in self.items)


def test_a_new_kind_is_its_payload_and_its_row() -> None:
    like = KINDS[RequestKind.FORWARD]
    row = replace(like, payload=EchoPayload, tokens=EchoPayload.count)  # every other fact as forward's row says
    sent = EchoPayload(items=(EchoItem([1, 2, 3], "a"), EchoItem([4])), scale=2, options={"k": [1, "x"]})
    wire = json.loads(encode_payload(sent))  # the queue's codec writes it with no code of its own
    got = from_json(row.payload, wire)
    assert got == sent and type(got.scale) is float and isinstance(got.items[0], EchoItem)
    assert row.tokens(got, None) == 4
    with pytest.raises(ValueError, match=r"items\[1\]\.tokens\[0\]: expected int, got str"):
        from_json(EchoPayload, {"items": [{"tokens": [1]}, {"tokens": ["1"]}]})
    with pytest.raises(ValueError, match=r"echo: unknown field\(s\) colour"):
        from_json(EchoPayload, {"colour": "red"})
    # Every row of the real table is complete in the same way: its payload decodes from its own JSON form.
    for spec in KINDS.values():
        default = spec.payload()
        assert from_json(spec.payload, json.loads(encode_payload(default))) == default
