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


def grouped():
    return {'lr': 3e-4, 'lora': {'rank': 0, 'alpha': 16.0, 'targets': 'q_proj'},
            'objectives': {'ce': {}}}


GROUPS = {'lora': {'rank': 'non-negative', 'alpha': 'positive'}}


def test_a_group_is_overridden_key_by_key(tmp_path):
    c = configure(grouped(), ['--lora.rank=8', '--lora.targets=123'], GROUPS)
    assert c['lora'] == {'rank': 8, 'alpha': 16.0, 'targets': '123'}
    c = configure(grouped(), ["--lora={'alpha': 32}"], GROUPS)  # the others keep theirs
    assert c['lora'] == {'rank': 0, 'alpha': 32.0, 'targets': 'q_proj'}
    assert type(c['lora']['alpha']) is float
    a = tmp_path / 'a.py'
    a.write_text("lora = dict(rank=4)\n")
    b = tmp_path / 'b.py'
    b.write_text("lora['alpha'] = lora['rank'] * 2\n")  # changed in place: still checked
    c = configure(grouped(), [str(a), str(b)], GROUPS)
    assert c['lora'] == {'rank': 4, 'alpha': 8.0, 'targets': 'q_proj'}
    # a dict that is not a group is replaced whole, as before
    c = configure(grouped(), ["--objectives={'kd': {}}"], GROUPS)
    assert c['objectives'] == {'kd': {}}
    assert grouped()['lora']['rank'] == 0


def test_a_group_key_is_checked_like_a_setting(tmp_path):
    with pytest.raises(SystemExit) as e:
        configure(grouped(), ['--lora.rnak=8'], GROUPS)
    assert str(e.value) == "error: unknown config key 'lora.rnak'; did you mean --lora.rank?"
    with pytest.raises(SystemExit, match=r"error: lora.rank must be int, got 1.5 \(float\)"):
        configure(grouped(), ['--lora.rank=1.5'], GROUPS)
    with pytest.raises(SystemExit) as e:
        configure(grouped(), ['--lora.rank=-1'], GROUPS)
    assert str(e.value) == ("error: lora.rank=-1 is out of range; set --lora.rank to a value "
                            "0 or above")
    with pytest.raises(SystemExit, match=r"error: lora is a group of settings, got 8"):
        configure(grouped(), ['--lora=8'], GROUPS)
    with pytest.raises(SystemExit, match="error: 'lr' is not a group of settings"):
        configure(grouped(), ['--lr.x=1'], GROUPS)
    with pytest.raises(SystemExit) as e:  # the old top-level name points to its group
        configure(grouped(), ['--alpha=2'], GROUPS)
    assert str(e.value) == ("error: unknown config key 'alpha'; it belongs to a group: "
                            "set --lora.alpha=VALUE (in a config file: lora['alpha'])")
    bad = tmp_path / 'bad.py'
    bad.write_text("lora['alpha'] = 0.0\n")
    with pytest.raises(SystemExit, match="lora.alpha=0.0 is out of range"):
        configure(grouped(), [str(bad)], GROUPS)
