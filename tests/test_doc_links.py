"""Every relative link and image in README.md and docs/*.md names a file of the checkout."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _targets(md: Path):
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)     # code blocks are not links
    for m in LINK.finditer(text):
        t = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", t) or t.startswith("#"):  # URLs, mailto:, anchors in the page
            continue
        yield t.split("#", 1)[0]


def test_relative_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = [f"{md.relative_to(ROOT)} -> {t}" for md in pages for t in _targets(md)
               if not (md.parent / t).exists()]
    assert pages[1:], "no docs/*.md found"
    assert not missing, "links to files that do not exist:\n" + "\n".join(missing)
