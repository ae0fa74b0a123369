"""Every ```python block in docs/*.md and README.md runs.

Conventions, each an HTML comment on the line right before the block's opening fence:

* ``<!-- no-test -->``: the block is not run (GPU-only snippets; keep these rare);
* ``<!-- requires: flax, equinox -->``: the block and the rest of its page are skipped when one of
  these modules is missing.

Blocks of one page run in order in one namespace (like a reader running them one after another).
A page may also hold hidden setup code, run where it appears, in a comment of the form
``<!-- test-setup`` ... ``-->`` (for example to define inputs that the text takes as given).
"""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

_FENCE = re.compile(r"^```python[ \t]*$")
_SETUP = re.compile(r"<!--\s*test-setup\s*\n(.*?)-->", re.S)


def extract(text):
  """``[(line, kind, code, requires)]`` with kind ``"block"``, ``"setup"`` or ``"skip"``."""
  lines = text.splitlines()
  items = []
  for m in _SETUP.finditer(text):
    items.append((text[:m.start()].count("\n") + 1, "setup", m.group(1), ()))
  i = 0
  while i < len(lines):
    if _FENCE.match(lines[i].strip()):
      start = i
      body = []
      i += 1
      while i < len(lines) and lines[i].strip() != "```":
        body.append(lines[i])
        i += 1
      prev = lines[start - 1].strip() if start > 0 else ""
      requires = ()
      m = re.fullmatch(r"<!--\s*requires:\s*(.*?)\s*-->", prev)
      if m:
        requires = tuple(x.strip() for x in m.group(1).split(",") if x.strip())
      kind = "skip" if re.fullmatch(r"<!--\s*no-test\s*-->", prev) else "block"
      items.append((start + 1, kind, "\n".join(body) + "\n", requires))
    i += 1
  return sorted(items, key=lambda x: x[0])


def test_extract_conventions():
  text = ("a\n```python\nx = 1\n```\n<!-- no-test -->\n```python\nboom()\n```\n"
          "<!-- requires: flax, equinox -->\n```python\ny = 2\n```\n<!-- test-setup\nz = 3\n-->\n")
  kinds = [(k, c.strip(), r) for _, k, c, r in extract(text)]
  assert kinds == [("block", "x = 1", ()), ("skip", "boom()", ()),
                   ("block", "y = 2", ("flax", "equinox")), ("setup", "z = 3", ())]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_doc_code_blocks_run(page, monkeypatch, capsys):
  items = [x for x in extract(page.read_text()) if x[1] != "skip"]
  if not items:
    pytest.skip(f"{page.name}: no python blocks")
  monkeypatch.chdir(ROOT)
  namespace = {"__name__": f"__docs_{page.stem}__"}
  for line, kind, code, requires in items:
    missing = [r for r in requires if importlib.util.find_spec(r) is None]
    if missing:
      pytest.skip(f"{page.name}:{line} and later blocks need {', '.join(missing)}")
    try:
      exec(compile(code, f"{page.name}:{line}", "exec"), namespace)  # pylint: disable=exec-used
    except Exception as e:  # pylint: disable=broad-except
      out = capsys.readouterr().out
      pytest.fail(f"{page.relative_to(ROOT)}, {kind} at line {line} failed: "
                  f"{type(e).__name__}: {e}\n--- code ---\n{code}--- stdout ---\n{out}")
