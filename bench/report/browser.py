"""A report page opened in a real headless browser (Chromium through Playwright): did every figure load,
did the page log an error; optionally a full-page screenshot.

    python -m bench.report.browser results/bench/report.html --screenshot docs/report.png

Chromium comes from the system's packages (``apt-get install chromium``) or ``MEDUSA_CHROMIUM``; Playwright's
own browser download is never needed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium_path() -> str:
    """The Chromium executable: ``MEDUSA_CHROMIUM``, else the first of the usual names on PATH."""
    given = os.environ.get("MEDUSA_CHROMIUM")
    if given:
        if not Path(given).is_file():
            raise FileNotFoundError(f"MEDUSA_CHROMIUM={given} is not a file")
        return given
    for name in _CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("no Chromium found: install it (apt-get install chromium) or set MEDUSA_CHROMIUM")


@dataclass(frozen=True)
class PageCheck:
    images: int  # <img> elements on the page
    loaded: int  # of those, decoded with a non-zero size
    broken: tuple[str, ...]  # alt texts of the others
    errors: tuple[str, ...]  # console errors and uncaught page errors
    title: str

    @property
    def ok(self) -> bool:
        return self.images == self.loaded and not self.errors


def check_page(page_file: str | os.PathLike[str], screenshot: str | os.PathLike[str] | None = None,
               timeout_s: float = 60.0) -> PageCheck:
    """Open ``page_file`` (file:// URL, no network) in headless Chromium and report what loaded."""
    from playwright.sync_api import sync_playwright  # playwright: optional (the test extra)

    path = Path(page_file).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no such page: {page_file}")
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"], timeout=timeout_s * 1000)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            page.goto(path.as_uri(), wait_until="load", timeout=timeout_s * 1000)
            state = page.evaluate("Array.from(document.images).map(i => [i.complete && i.naturalWidth > 0, i.alt])")
            title = page.title()
            if screenshot is not None:
                Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    return PageCheck(len(state), sum(ok for ok, _ in state), tuple(alt for ok, alt in state if not ok),
                     tuple(errors), title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report.browser", description=__doc__.splitlines()[0])
    parser.add_argument("page", help="an HTML file (a bench run's report.html)")
    parser.add_argument("--screenshot", default=None, help="write a full-page PNG screenshot here")
    args = parser.parse_args(argv)
    from playwright.sync_api import Error as BrowserError  # playwright: optional (the test extra)

    try:
        check = check_page(args.page, args.screenshot)
    except (OSError, RuntimeError, BrowserError) as exc:
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"{args.page}: '{check.title}', {check.loaded}/{check.images} figures loaded, {len(check.errors)} errors"
          + "".join(f"\n  {e}" for e in check.errors) + "".join(f"\n  not loaded: {b}" for b in check.broken))
    return 0 if check.ok else 1


if __name__ == "__main__":
    sys.exit(main())
