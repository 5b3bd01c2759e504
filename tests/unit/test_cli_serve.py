"""`loraplex serve`'s arguments: several --base-model need --embedded (one pool each), answered in one line."""

from __future__ import annotations

import pytest

from loraplex.launch.cli import main


def test_several_base_models_without_embedded_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--base-model", "tiny", "--base-model", "tiny-moe"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "several --base-model need --embedded" in err
