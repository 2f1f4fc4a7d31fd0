import pytest

from configurator import configure


def defaults():
    return {'batch_size': 12, 'lr': 3e-4, 'out_dir': 'out', 'compile': False, 'init_from': 'scratch'}


def test_overrides_and_types():
    c = configure(defaults(), ['--batch_size=32', '--lr=1', '--compile=True', '--init_from=resume', '--out_dir=123'])
    assert c == {'batch_size': 32, 'lr': 1.0, 'out_dir': '123', 'compile': True, 'init_from': 'resume'}
    assert type(c['lr']) is float


def test_config_files_apply_in_order_then_flags(tmp_path):
    a, b = tmp_path / 'a.py', tmp_path / 'b.py'
    a.write_text("import math\nbatch_size = 8\nlr = 1e-3\n")
    b.write_text("batch_size = batch_size * 2\n_private = 1\n")
    c = configure(defaults(), [str(a), str(b), '--lr=2e-3'])
    assert c['batch_size'] == 16 and c['lr'] == 2e-3 and '_private' not in c and 'math' not in c


def test_unknown_key_suggests_closest():
    with pytest.raises(SystemExit) as e:
        configure(defaults(), ['--batch_sise=4'])
    assert str(e.value) == "error: unknown config key 'batch_sise'; did you mean --batch_size?"


def test_wrong_type_is_rejected():
    with pytest.raises(SystemExit, match=r"error: batch_size must be int, got 1.5 \(float\)"):
        configure(defaults(), ['--batch_size=1.5'])
    with pytest.raises(SystemExit, match="compile must be bool"):
        configure(defaults(), ['--compile=1'])


def test_bad_config_file_and_bad_flag(tmp_path):
    with pytest.raises(SystemExit, match="config file 'nope.py' not found"):
        configure(defaults(), ['nope.py'])
    bad = tmp_path / 'bad.py'
    bad.write_text("learning_rat = 1e-3\n")
    with pytest.raises(SystemExit, match="unknown config key 'learning_rat'"):
        configure(defaults(), [str(bad)])
    with pytest.raises(SystemExit, match="expected --key=value"):
        configure(defaults(), ['--compile'])


def test_declared_ranges_are_checked_after_files_and_flags(tmp_path):
    ranges = {'batch_size': 'positive', 'lr': 'non-negative', 'out_dir': 'non-empty',
              'init_from': ('scratch', 'resume')}
    assert configure(defaults(), ['--lr=0'], ranges)['lr'] == 0.0
    with pytest.raises(SystemExit) as e:
        configure(defaults(), ['--batch_size=0'], ranges)
    assert str(e.value) == "error: batch_size=0 is out of range; set --batch_size to a value above 0"
    with pytest.raises(SystemExit, match=r"error: lr=-1.0 is out of range; set --lr to a value 0 or above"):
        configure(defaults(), ['--lr=-1'], ranges)
    with pytest.raises(SystemExit, match="error: out_dir='' is out of range; set --out_dir to a value that is not empty"):
        configure(defaults(), ['--out_dir='], ranges)
    with pytest.raises(SystemExit, match="error: init_from='x' is not allowed; set --init_from to one of 'scratch', 'resume'"):
        configure(defaults(), ['--init_from=x'], ranges)
    bad = tmp_path / 'bad.py'
    bad.write_text("batch_size = -4\n")  # a config file is held to the same ranges
    with pytest.raises(SystemExit, match="batch_size=-4 is out of range"):
        configure(defaults(), [str(bad)], ranges)


def test_positional_words_are_split_off_and_checked():
    from configurator import words
    assert words(['kernels', '--x=1', 'decode'], allowed=('kernels', 'decode')) == (['kernels', 'decode'], ['--x=1'])
    with pytest.raises(SystemExit, match="error: unknown word 'kernals'; choose from kernels, decode"):
        words(['kernals'], allowed=('kernels', 'decode'))
    with pytest.raises(SystemExit, match="error: too many words"):
        words(['a', 'b'], most=1)
    with pytest.raises(SystemExit, match="error: expected --key=value, got 'batch_size=4'; add the --"):
        configure(defaults(), ['batch_size=4'])
