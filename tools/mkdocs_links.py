"""A mkdocs hook: the docs paths docstrings cite as plain text (``see
docs/concepts/lifetimes.md#fork``) become links in the rendered site, relative to the
page they appear on. A path to a page that does not exist, or an anchor the built page
does not have, is a warning (an error under ``mkdocs build --strict``)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from mkdocs.utils import get_relative_url

log = logging.getLogger("mkdocs.hooks.links")

# A cited page: `docs/<section>/<page>.md`, with an optional `#anchor`; not inside an
# attribute or a longer path (the characters before it).
_CITED = re.compile(
    r"(?<![\w/.\"'=#-])docs/((?:concepts|how-to|tutorials|reference)/[\w-]+\.md)(#[\w-]+)?"
)
# Where a citation is left as it is: code blocks and existing links.
_SKIP = re.compile(r"<pre\b.*?</pre>|<a\b.*?</a>", re.DOTALL)

_anchors: list[tuple[str, str, str]] = []  # (citing page, target page's url, anchor)


def on_pre_build(config: Any) -> None:
    _anchors.clear()


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    def link(match: re.Match[str]) -> str:
        path, anchor = match.group(1), match.group(2) or ""
        target = files.get_file_from_path(path)
        if target is None:
            log.warning(
                "%s cites docs/%s, which is not a page of the site", page.file.src_uri, path
            )
            return match.group(0)
        if anchor:
            _anchors.append((page.file.src_uri, target.url, anchor[1:]))
        href = get_relative_url(target.url, page.url) + anchor
        return f'<a href="{href}">{match.group(0)}</a>'

    pieces: list[str] = []
    last = 0
    for skipped in _SKIP.finditer(html):
        pieces.append(_CITED.sub(link, html[last : skipped.start()]))
        pieces.append(skipped.group(0))
        last = skipped.end()
    pieces.append(_CITED.sub(link, html[last:]))
    return "".join(pieces)


def on_post_build(config: Any) -> None:
    site = Path(config["site_dir"])
    ids: dict[str, set[str]] = {}
    for citing, url, anchor in _anchors:
        if url not in ids:
            built = site / url / "index.html" if url.endswith("/") or not url else site / url
            text = built.read_text() if built.exists() else ""
            ids[url] = set(re.findall(r'\bid="([^"]+)"', text))
        if anchor not in ids[url]:
            log.warning("%s cites %s#%s: the page has no such anchor", citing, url, anchor)
