"""README.md stays true: its Python snippets run, its links resolve."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, 'README.md')).read()
SNIPPETS = re.findall(r'```python\n(.*?)```', README, re.S)


def test_readme_is_short_and_starts_with_the_two_commands():
  assert len(README.splitlines()) <= 250
  commands = re.findall(r'```bash\n(.*?)```', README, re.S)[:2]
  assert 'python train.py' in commands[0]
  assert 'pytest' in commands[1]


@pytest.mark.parametrize('snippet', SNIPPETS,
                         ids=[f'snippet{i}' for i in range(len(SNIPPETS))])
def test_python_snippet_runs(snippet):
  exec(compile(snippet, 'README.md', 'exec'), {'__name__': '__readme__'})


def test_links_resolve():
  for target in re.findall(r'\]\(([^)#]+)(?:#([^)]+))?\)', README):
    path, anchor = target
    if path.startswith('http'):
      continue
    full = os.path.join(ROOT, path)
    assert os.path.exists(full), path
    if anchor:
      text = open(full).read()
      assert (f'id="{anchor}"' in text
              or re.search(rf'^#+ .*{re.escape(anchor)}', text, re.M)
              or f'{{#{anchor}}}' in text), f'{path}#{anchor}'


def test_no_reference_outside_the_repository():
  assert 'DESIGN' not in README
