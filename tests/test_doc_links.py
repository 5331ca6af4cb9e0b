"""Every relative link and image in README.md and docs/*.md names a file of the checkout."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^\"']*[\"'])?\s*\)")   # [text](path "title")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)                # [label]: path
IMG = re.compile(r"<img\s[^>]*src=[\"']([^\"']+)[\"']", re.I)


def _prose(text: str) -> str:
    """The page less what is not a link: fenced blocks (``` and ~~~), indented blocks, code spans."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    text = re.sub(r"(?:^(?: {4}|\t).*\n?)+", "", text, flags=re.M)
    return re.sub(r"(`+)(?!`).+?(?<!`)\1(?!`)", "", text, flags=re.S)


def _targets(md: Path):
    text = _prose(md.read_text())
    for rx in (INLINE, REFDEF, IMG):
        for m in rx.finditer(text):
            t = m.group(1)
            if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", t) or t.startswith("#"):   # URLs, mailto:, this page
                continue
            yield t.split("#", 1)[0]


def _exists(md: Path, t: str) -> bool:
    return (ROOT / t.lstrip("/") if t.startswith("/") else md.parent / t).exists()   # /x: from the checkout


def test_relative_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert pages[1:], "no docs/*.md found"
    found = [(md, t) for md in pages for t in _targets(md)]
    assert len(found) > 20, f"only {len(found)} links found: the patterns no longer match the pages"
    missing = [f"{md.relative_to(ROOT)} -> {t}" for md, t in found if not _exists(md, t)]
    assert not missing, "links to files that do not exist:\n" + "\n".join(missing)


def test_patterns(tmp_path):
    md = tmp_path / "p.md"
    md.write_text('see [a](x.md "title") and ![i](img/y.png), `[not](code.md)`, <img src="z.png">\n'
                  "[ref]: r.md\n\n```\n[no](fenced.md)\n```\n\n    [no](indented.md)\n"
                  "[web](https://example.org/a) [here](#part) [mail](mailto:a@b)\n")
    assert sorted(_targets(md)) == ["img/y.png", "r.md", "x.md", "z.png"]
