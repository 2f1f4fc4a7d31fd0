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
