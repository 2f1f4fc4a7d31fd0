"""The layout stays as designed: one concern per file, each inside its line budget, lines not
packed, and imports pointing one way (scripts -> the pieces -> model -> bitlinear -> kernels;
tokenizer and hub at the bottom). Read from the source files, so it stays true."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# non-blank lines, a line over 100 characters counting once per started 100: the guide sizes
# of the design, each a rough size for a lesson on that concern. A file that outgrows its guide
# because its concern grew raises its number here, with the reason beside it. train.py: the
# declared ranges of its settings (19 lines) and the start-of-run checks of out_dir, device and
# eval_tasks; arms.py: a sweep file's required settings, each checked at its top; bench.py:
# the conversion step run by train.py per phase, the kernels one BitLinear launches, torchao
BUDGETS = {'bitlinear.py': 390, 'kernels.py': 550, 'model.py': 570, 'moe.py': 150,
           'engine.py': 300, 'lora.py': 150, 'objectives.py': 550, 'optim.py': 300,
           'tokenizer.py': 250, 'hub.py': 250, 'data.py': 520, 'checkpoint.py': 250,
           'gguf_export.py': 300, 'eval.py': 300, 'rl.py': 300, 'train.py': 635,
           'configurator.py': 100, 'sample.py': 120, 'bench.py': 530, 'sweep.py': 150,
           'arms.py': 125, 'remote.py': 250, 'teachers.py': 150, 'teach.py': 120}
# a module may import project modules of lower levels only (tokenizer may use hub, beside it);
# among the pieces, engine opens checkpoints (checkpoint, lora); eval and rl run what engine samples
LEVELS = {'kernels': 0, 'hub': 0, 'tokenizer': 0, 'bitlinear': 1, 'moe': 1, 'model': 2,
          'objectives': 3, 'optim': 3, 'data': 3, 'checkpoint': 3, 'lora': 3,
          'gguf_export': 3, 'configurator': 3, 'engine': 4, 'eval': 5, 'rl': 5,
          'train': 6, 'sample': 6, 'teach': 6, 'bench': 6, 'sweep': 6, 'arms': 5,
          'remote': 4, 'teachers': 4}
BESIDE = {('tokenizer', 'hub')}
# files that work when copied alone need nothing of the project (bitlinear.py falls back
# to pure torch without kernels.py)
ALONE = ('objectives', 'kernels', 'hub', 'configurator', 'moe')


def lines(name):
    with open(os.path.join(ROOT, name)) as f:
        return [line.rstrip('\n') for line in f]


def project_imports(name):
    """The project modules a file imports, wherever in the file."""
    tree = ast.parse(open(os.path.join(ROOT, name)).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split('.')[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module.split('.')[0])
    return found & set(LEVELS)


def test_every_python_file_at_the_top_is_in_the_layout():
    here = {f for f in os.listdir(ROOT) if f.endswith('.py')}
    assert here == set(BUDGETS)


@pytest.mark.parametrize('name', sorted(BUDGETS))
def test_inside_budget_and_not_packed(name):
    text = [line for line in lines(name) if line.strip()]
    count = sum((len(line) + 99) // 100 for line in text)
    assert count <= BUDGETS[name], f"{name}: {count} lines, budget {BUDGETS[name]}"
    dense = [line for line in text if 90 <= len(line) <= 100]
    assert len(dense) <= 0.08 * len(text), f"{name}: {len(dense)} of {len(text)} at 90-100"
    assert all(len(line) <= 100 for line in text), f"{name} has lines over 100 characters"


@pytest.mark.parametrize('name', sorted(BUDGETS))
def test_imports_point_down(name):
    me = name.removesuffix('.py')
    for other in project_imports(name):
        down = LEVELS[other] < LEVELS[me] or (me, other) in BESIDE
        assert down, f"{name} imports {other}: against the flow of the layout"
    if me in ALONE:
        assert not project_imports(name), f"{name} must work when copied alone"


def test_bitlinear_needs_kernels_only_when_it_is_there():
    tree = ast.parse(open(os.path.join(ROOT, 'bitlinear.py')).read())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(getattr(n, 'module', None) != 'kernels' for n in top)  # only inside try
    tries = [n for n in tree.body if isinstance(n, ast.Try)]
    assert any(isinstance(h.type, ast.Name) and h.type.id == 'ImportError'
               for t in tries for h in t.handlers)
