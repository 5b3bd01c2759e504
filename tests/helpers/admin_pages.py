"""Driving the web admin's pages in a real browser (Playwright pages), shared by tests/e2e and tests/security."""

from __future__ import annotations

from typing import Any


def revoke_key_in_list(page: Any, base_url: str, key_id: str, query: str = "") -> None:
    """Revoke an API key through the keys list's action menu: select its row, pick Revoke, confirm."""
    page.goto(f"{base_url}/admin/api-key/list{query}")
    page.locator(f"tr:has(input[type=hidden][value='{key_id}']) input.select-box").check()
    page.click("#dropdownMenuButton")
    page.click("#action-customconfirm-revoke")
    with page.expect_navigation():
        page.click("#action-custom-modal-revoke")
