"""The layout stays as designed: one concern per file, lines not packed, imports pointing one way
(scripts -> the pieces -> model -> bitlinear -> kernels; tokenizer, hub and report at the bottom),
and no coupling that is not an import: no script running another's text, one opener of
checkpoints, no file changing another file's objects or functions, and train.py's functions
taking what they use. Read from the source files, so it stays true."""
import ast
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# every top-level file and its level: a module may import project modules of lower levels
# only (tokenizer may use hub, and hub report, beside them). checkpoint opens checkpoints for
# everyone, so it sits above model and lora, and below teachers; eval and rl run what engine
# samples
LEVELS = {'kernels': 0, 'hub': 0, 'tokenizer': 0, 'report': 0, 'bitlinear': 1, 'moe': 1,
          'hf_layout': 1, 'model': 2, 'objectives': 3, 'optim': 3, 'data': 3, 'lora': 3, 'gguf_export': 3,
          'configurator': 3, 'checkpoint': 4, 'engine': 4, 'teachers': 5, 'remote': 5, 'run_state': 5,
          'eval': 5, 'rl': 5, 'arms': 5, 'train': 6, 'sample': 6, 'export': 6, 'teach': 6,
          'bench': 6, 'sweep': 6}
BESIDE = {('tokenizer', 'hub'), ('hub', 'report'), ('hf_layout', 'moe')}
# files that work when copied alone need nothing of the project (bitlinear.py falls back
# to pure torch without kernels.py)
ALONE = ('objectives', 'kernels', 'report', 'configurator', 'moe')
FILES = sorted(f'{name}.py' for name in LEVELS)


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


def tree(name):
    return ast.parse(open(os.path.join(ROOT, name)).read())


def test_every_python_file_at_the_top_is_in_the_layout():
    here = {f for f in os.listdir(ROOT) if f.endswith('.py')}
    assert here == set(FILES)


@pytest.mark.parametrize('name', FILES)
def test_lines_not_packed(name):
    text = [line for line in lines(name) if line.strip()]
    dense = [line for line in text if 90 <= len(line) <= 100]
    assert len(dense) <= 0.08 * len(text), f"{name}: {len(dense)} of {len(text)} at 90-100"
    assert all(len(line) <= 100 for line in text), f"{name} has lines over 100 characters"


@pytest.mark.parametrize('name', FILES)
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


def module_names(body):
    """The names a module binds at its top level (inside ifs, trys and withs too):
    {name: 'import' | 'def' | 'value'}."""
    names = {}
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                names[(a.asname or a.name).split('.')[0]] = 'import'
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = 'def'
        else:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.setdefault(sub.id, 'value')
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    names[sub.name] = 'def'
            for block in ('body', 'orelse', 'finalbody', 'handlers'):
                inner = module_names(getattr(node, block, []) or [])
                names.update({k: v for k, v in inner.items() if v != 'value'})
    return names


def settings_of(source):
    """train.py's settings: the names set between its two rulers."""
    block = source.split('# ' + '-' * 77)[1]
    return set(re.findall(r'^(\w+) *=', block, re.M))


def size(name, node=None):
    """Non-blank lines (of a top-level class or function when given), a line over 100
    characters counting once per started 100, as the design counts them."""
    text = lines(name)[node.lineno - 1:node.end_lineno] if node else lines(name)
    return sum(-(-len(line) // 100) for line in text if line.strip())


def used_before_defined(name):
    """(definition, name) for each top-level name a top-level function or class of the file
    uses above the line that defines it."""
    body = tree(name).body
    defined = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.setdefault(node.name, node.lineno)
        elif isinstance(node, ast.Assign):
            for t in (t for t in node.targets if isinstance(t, ast.Name)):
                defined.setdefault(t.id, node.lineno)
    return sorted({(node.name, n.id) for node in body
                   if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                   for n in ast.walk(node) if isinstance(n, ast.Name)
                   and isinstance(n.ctx, ast.Load) and defined.get(n.id, 0) > node.lineno})


@pytest.mark.parametrize('name', ['bitlinear.py', 'model.py'])
def test_a_reader_meets_every_name_before_its_use(name):
    """Read top to bottom, every top-level name is introduced before it is used: defined
    above, or (where a definition calls a later part's helper) named in the module
    docstring's outline."""
    outline = ast.get_docstring(tree(name))
    late = [(user, used) for user, used in used_before_defined(name) if f'`{used}`' not in outline]
    assert not late, f"{name}: used before they are introduced: {late}"


def test_bitlinear_is_four_parts_definition_first():
    """bitlinear.py: (1) the definition, nothing of kernels, reuse, blocks or autocast in it;
    (2) the same numbers in less memory and time; (3) options, the shape of gamma tested in
    one helper; (4) pack and freeze; at most 320 lines, the docstring in the same headings."""
    text = '\n'.join(lines('bitlinear.py'))
    heads = ['1. the definition', '2. the same numbers in less memory and time', '3. options',
             '4. pack and freeze']
    rulers = [re.search(r'^# -+ ' + re.escape(h) + '$', text, re.M) for h in heads]
    assert all(rulers) and [r.start() for r in rulers] == sorted(r.start() for r in rulers)
    outline = ast.get_docstring(tree('bitlinear.py')).lower()
    assert all(h[:12] in outline for h in heads)
    definition = text[rulers[0].end():rulers[1].start()]
    for machinery in ('kernels', 'reused', 'BLOCK', 'autocast', 'holding'):
        assert machinery not in definition, machinery
    assert text.count('gamma.shape[1]') == 1 and 'def blocks_of' in text  # gamma's shape, once
    assert size('bitlinear.py') <= 320


def test_model_is_the_decoder_and_nothing_of_the_machine():
    """model.py reads top to bottom: at most 400 lines, Transformer at most 150, no branch for
    a fixed-shape (CUDA graph) step, no hook for the profiler and no inference switch (fused
    projections, an int8 head: engine.py's modules); the block loop in at most 10 lines."""
    assert size('model.py') <= 400
    classes = {n.name: n for n in tree('model.py').body if isinstance(n, ast.ClassDef)}
    assert size('model.py', classes['Transformer']) <= 150
    text = '\n'.join(lines('model.py'))
    assert 'is_tensor' not in text and 'use_attention' not in text and 'self.attend' not in text
    assert not re.search(r'fused|head8|use_head|int8', text)
    forward = next(n for n in classes['Transformer'].body if getattr(n, 'name', '') == 'forward')
    loop = next(n for n in ast.walk(forward) if isinstance(n, ast.For))
    assert loop.end_lineno - loop.lineno + 1 <= 10
    # a derived config is a new one (dataclasses.replace checks it), never the old one changed
    assert '.__post_init__()' not in text and not re.search(r'config\.\w+ = ', text)


def test_train_is_settings_then_a_short_set_up_then_the_loop():
    """train.py in nanoGPT's order: at most 60 settings between the rulers (a setting only
    one feature reads sits in that feature's group), then at most 220 lines of set-up
    before the training loop; each optional feature is set up by its own module, and one
    place (configurator.one_line) turns a set-up mistake into its one-line exit."""
    source = open(os.path.join(ROOT, 'train.py')).read()
    assert len(settings_of(source)) <= 60
    text = lines('train.py')
    ruler = max(i for i, line in enumerate(text) if line == '# ' + '-' * 77)
    loop = next(i for i, line in enumerate(text) if line.startswith('while run.step'))
    assert loop - ruler <= 220, f"{loop - ruler} lines of set-up"
    setup = '\n'.join(text[ruler:loop])
    assert 'except' not in setup and 'sys.exit(f' not in setup


def test_train_functions_take_what_they_use():
    """No function of train.py reads more than 5 module-level names other than imports,
    functions and constants, settings counted: the run's state travels as arguments or in
    run_state.TrainState, not through a web of globals."""
    source = open(os.path.join(ROOT, 'train.py')).read()
    module = ast.parse(source)
    kinds = module_names(module.body)
    state = {n for n, k in kinds.items() if k == 'value' and not n.isupper()}
    # the check sees the set-up's values and the settings
    assert {'ddp', 'master', 'manager', 'batches', 'max_steps', 'fsdp'} <= state
    for fn in [n for n in ast.walk(module) if isinstance(n, ast.FunctionDef)]:
        local = {a.arg for n in ast.walk(fn) if isinstance(n, ast.arguments)
                 for a in n.args + n.kwonlyargs}
        local |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                  and isinstance(n.ctx, ast.Store)}
        read = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)
                and isinstance(n.ctx, ast.Load)}
        used = sorted((read - local) & state)
        assert len(used) <= 5, f"train.py {fn.name}() reads {len(used)} globals: {used}"


def calls(name):
    return [n for n in ast.walk(tree(name)) if isinstance(n, ast.Call)]


def dotted(node):
    """'a.b.c' for an attribute chain on a name, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return '.'.join([node.id] + parts[::-1]) if isinstance(node, ast.Name) else ''


@pytest.mark.parametrize('name', FILES)
def test_no_script_runs_another_files_text(name):
    """Config and sweep files are code by design (configurator.py, arms.py's runpy of a
    sweep file); no file runs another project file's text to learn what it holds."""
    for call in calls(name):
        f = call.func
        if isinstance(f, ast.Name) and f.id in ('exec', 'eval'):
            assert name == 'configurator.py', f"{name} calls {f.id}()"
        if dotted(f) in ('runpy.run_path', 'runpy.run_module') and call.args:
            arg = ast.unparse(call.args[0])
            assert not re.search(r"\w+\.py'", arg), f"{name} runs {arg}"


@pytest.mark.parametrize('name', FILES)
def test_only_checkpoint_opens_checkpoints(name):
    """torch.load, safetensors' load_file / safe_open and Transformer.from_pretrained appear
    in checkpoint.py (and model.py, which defines from_pretrained, and hf_layout.py, which
    reads its files) only: every script opens a checkpoint through checkpoint.py, so all
    find, verify and pick the tokenizer alike."""
    if name in ('checkpoint.py', 'model.py', 'hf_layout.py'):
        return
    openers = ('torch.load', 'Transformer.from_pretrained', 'load_file', 'safe_open')
    for call in calls(name):
        called = dotted(call.func)
        assert called not in openers and not called.endswith(('.load_file', '.safe_open')), \
            f"{name} opens a checkpoint itself ({called})"


def own_attributes(name):
    """The attributes a file's classes define: self.x assignments, class-level names and
    methods."""
    own = set()
    for cls in [n for n in ast.walk(tree(name)) if isinstance(n, ast.ClassDef)]:
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == 'self':
                own.add(node.attr)
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                own.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
            elif isinstance(node, ast.Assign):
                own |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return own


def assigned(name):
    """Every attribute or item a file assigns to: (target node, line)."""
    targets = []
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Assign):
            found = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            found = [node.target]
        else:
            continue
        for t in found:
            targets += [n for n in ast.walk(t) if isinstance(n, (ast.Attribute, ast.Subscript))
                        and isinstance(n.ctx, ast.Store)]
    return targets


@pytest.mark.parametrize('name', FILES)
def test_no_file_changes_another_files_objects_or_functions(name):
    """An object is changed through what its own file offers (methods such as
    Transformer.checkpoint_activations, forward hooks, torch's set_submodule), never by assigning to an
    attribute another file's classes define (an autograd Function's ctx is torch's, made to
    carry what backward needs); and no module's function or global is replaced from outside
    (torch.backends' switches are settings, made to be set)."""
    others = set().union(*(own_attributes(f) for f in FILES if f != name))
    mine = own_attributes(name)
    modules = {k for k, v in module_names(tree(name).body).items() if v == 'import'}
    for t in assigned(name):
        base = t.value
        while isinstance(base, (ast.Attribute, ast.Subscript)):
            base = base.value
        root = base.id if isinstance(base, ast.Name) else ''
        where = f"{name} line {t.lineno}: {ast.unparse(t)}"
        if root in modules:
            assert dotted(t).startswith('torch.backends.'), f"{where} patches a module"
        if isinstance(t, ast.Attribute) and root not in ('self', 'cls', 'ctx'):
            assert t.attr in mine or t.attr not in others, \
                f"{where} sets an attribute another file's classes define"


def test_each_test_worker_takes_its_share_of_the_cores():
    """conftest.py: under pytest-xdist each worker (and what it starts) runs on its share of the
    cores, so that two workers' torch threads do not spin on the same ones."""
    import torch
    if 'PYTEST_XDIST_WORKER' not in os.environ:
        pytest.skip('one process: torch keeps its own default')
    share = max(1, (os.cpu_count() or 1) // int(os.environ['PYTEST_XDIST_WORKER_COUNT']))
    assert int(os.environ['OMP_NUM_THREADS']) == share
    assert torch.get_num_threads() == share


ARCHIVE = re.compile(r'\.(whl|tar|tar\.gz|tgz|tar\.bz2|tar\.xz|zip|gz|xz|bz2|7z|gguf|safetensors|pt|bin)$')


def test_the_repository_holds_only_the_project():
    """No tracked download, archive or weight file, and nothing over 1 MB: a clone gets the
    project, not what pip or a run left beside it."""
    tracked = subprocess.run(['git', 'ls-files', '-z'], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split('\0')
    tracked = [path for path in tracked if path]
    assert tracked, 'git ls-files listed nothing'
    archives = [path for path in tracked if ARCHIVE.search(path)]
    assert not archives, f'archives tracked: {archives}'
    large = [path for path in tracked
             if os.path.exists(os.path.join(ROOT, path))
             and os.path.getsize(os.path.join(ROOT, path)) > 1_000_000]
    assert not large, f'files over 1 MB tracked: {large}'


def anchors(path):
    """The anchors of a Markdown file's headings, as GitHub makes them."""
    found = set()
    for line in open(path):
        if line.startswith('#'):
            title = line.lstrip('#').strip().lower()
            found.add(re.sub(r'[^\w\- ]', '', title).replace(' ', '-'))
    return found


def test_every_relative_link_in_readme_and_docs_resolves():
    """Each link that is not a URL names a file of the repository, seen from the linking file,
    and each #anchor a heading of the file it points to."""
    pages = ['README.md'] + [f'docs/{name}' for name in sorted(os.listdir(os.path.join(ROOT, 'docs')))
                             if name.endswith('.md')]
    broken = []
    for page in pages:
        text = open(os.path.join(ROOT, page)).read()
        for link in re.findall(r'\]\(([^)\s]+)\)', text):
            if re.match(r'[a-z]+:', link):
                continue
            path, _, anchor = link.partition('#')
            target = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path or os.path.basename(page)))
            if not os.path.exists(target):
                broken.append((page, link))
            elif anchor and target.endswith('.md') and anchor not in anchors(target):
                broken.append((page, link))
    assert len(pages) > 5 and not broken, broken


def test_readme_reads_run_then_the_reading_path_then_test():
    """The front door in the order a newcomer needs it: what to run, what to read, how to test."""
    headings = [line for line in lines('README.md') if line.startswith('## ')]
    order = [headings.index(h) for h in ('## Run', '## Reading path', '## Test', '## Results')]
    assert order == sorted(order), headings


def test_readme_results_are_a_dozen_short_lines():
    """The headline figures fit on a screen: at most 12 lines, none of 200 characters or more; the
    write-ups live in docs/."""
    text = open(os.path.join(ROOT, 'README.md')).read()
    section = text.split('## Results', 1)[1].split('\n## ', 1)[0]
    written = [line for line in section.splitlines() if line.strip()]
    assert 5 <= len(written) <= 12, written
    assert all(len(line) < 200 for line in written), max(written, key=len)


def test_a_derived_model_config_is_a_new_checked_one():
    """to_bitnet, upcycle, add_lrc and freeze give the model a new config (dataclasses.replace, which
    runs the checks): the one it had is left as it was, and a bad derived one is refused."""
    from model import ModelConfig, Transformer
    cfg = ModelConfig(vocab_size=64, n_layer=1, n_embd=32, n_head=2, n_kv_head=1, intermediate_size=64)
    model = Transformer(cfg)
    model.to_bitnet(weight_scale='row').add_lrc(2)
    assert not cfg.bitnet and cfg.weight_scale == 'matrix' and cfg.lrc_rank == 0
    assert model.config.bitnet and model.config.subln and model.config.weight_scale == 'row' and model.config.lrc_rank == 2
    with pytest.raises(ValueError, match="weight_scale='block' needs"):
        Transformer(cfg).to_bitnet(weight_scale='block')
    with pytest.raises(ValueError, match='top_k=3 must be between 1 and n_experts=2'):
        Transformer(cfg).upcycle(2, top_k=3)
    assert cfg.n_experts == 0
