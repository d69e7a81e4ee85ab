"""The repository's references to its own documents resolve: every
`RESULTS.md "section"`, `RESULTS `section``, `FILE.md#anchor` named in code,
tests, configs and docs is an anchor (or a heading) of that file, and no
file refers to a document outside the repository."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = {'RESULTS': 'benchmarks/RESULTS.md', 'decisions': 'docs/decisions.md',
        'design': 'docs/design.md', 'convert': 'docs/convert.md',
        'fp8_matmul': 'docs/fp8_matmul.md'}
REFERENCE = re.compile(
    r'(RESULTS)(?:\.md)? ?(?:"([^"\n]+)"|`([a-z0-9-]+)`)'
    r'|(RESULTS|decisions|design|convert|fp8_matmul)\.md#([a-z0-9-]+)')


def _sources():
  for pattern in ('coat_jax/**/*.py', 'pallas_kernels/**/*.py',
                  'benchmarks/*.py', 'tests/**/*.py', 'configs/*.py',
                  'train.py', 'docs/*.md', 'benchmarks/RESULTS.md',
                  'README.md'):
    yield from glob.glob(os.path.join(ROOT, pattern), recursive=True)


def _targets(doc: str) -> set[str]:
  text = open(os.path.join(ROOT, DOCS[doc])).read()
  return (set(re.findall(r'id="([^"]+)"', text))
          | {h.strip() for h in re.findall(r'^#+ (.*)$', text, re.M)})


def test_references_to_the_documents_resolve():
  targets = {doc: _targets(doc) for doc in DOCS}
  missing = []
  for path in _sources():
    if path.endswith('docs_test.py'):
      continue
    for m in REFERENCE.finditer(open(path).read()):
      doc = m[1] or m[4]
      name = m[2] or m[3] or m[5]
      found = name in targets[doc] or any(
          name in heading for heading in targets[doc])
      if not found:
        missing.append(f'{os.path.relpath(path, ROOT)}: {doc} {name!r}')
  assert not missing, missing


def test_nothing_refers_outside_the_repository():
  offenders = [os.path.relpath(p, ROOT) for p in _sources()
               if not p.endswith('docs_test.py')
               and re.search(r'DESIGN(\.md| section)|HISTORY\.md|NOTES\.md',
                             open(p).read())]
  assert not offenders, offenders
